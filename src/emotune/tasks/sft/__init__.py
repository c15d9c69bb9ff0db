"""`task: sft`: supervised fine-tuning on instruction rows; ROUGE-L, BLEU, perplexity and a forgetting probe before and after."""
