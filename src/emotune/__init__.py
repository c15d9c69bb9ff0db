"""emotune: turn an instruction-tuned LLM into a measured, deployable classifier with LoRA."""

__version__ = "0.1.0"
