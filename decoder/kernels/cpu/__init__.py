"""CPU kernels (numba): MoE experts computed on their quantized GGUF blocks."""
