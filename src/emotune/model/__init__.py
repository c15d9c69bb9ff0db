"""The model: sources and loading, LoRA and quantization, lean kernels, shared prefix, heads, the adapter folder format."""
