"""`task: classify`: an instruction-tuned model answers with a label word; measured by generation and label scoring."""
