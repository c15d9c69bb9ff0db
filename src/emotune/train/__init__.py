"""Training: the loop, batches and their loss masks, the memory plan, checkpoints, the training log."""
