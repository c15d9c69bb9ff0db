"""The model: sources and loading, chat turns, attention choices, LoRA and quantization, lean kernels, shared prefix,
heads, the adapter folder format."""
