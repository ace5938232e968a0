"""Generation: the loop, sampling, the tokenizer from GGUF metadata, routing trace recording."""
