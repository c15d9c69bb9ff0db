"""The model layer: sources and loading, chat turns, attention choices, LoRA, quantization, heads."""
