"""Models: sources and loading, LoRA and lean kernels, the shared prefix, heads, the adapter folder format."""
