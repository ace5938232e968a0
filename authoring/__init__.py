"""Authoring tools: make tiny GGUF MoE models (writer, quantizers, tokenizer data) and replay
routing traces through cache policies. Neither process imports these at run time; they are
how tests, demos and benchmarks make their inputs."""
