"""Deploy layer: export, merge, GGUF, hub."""
