"""Deploy layer: export, merge, GGUF for llama.cpp and Ollama, hub publishing with a model card."""
