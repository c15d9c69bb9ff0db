"""Deployment: export (merged model, adapter), GGUF for llama.cpp and Ollama, hub publishing with a model card,
prediction with a trained artifact."""
