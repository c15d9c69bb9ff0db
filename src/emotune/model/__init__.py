"""Model layer: sources and loading, LoRA and quantization, kernels, heads, the adapter folder format."""
