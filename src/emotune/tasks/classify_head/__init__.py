"""`task: classify_head`: a classification head on the last token, trained with LoRA; the base model's zero-shot score as the before."""
