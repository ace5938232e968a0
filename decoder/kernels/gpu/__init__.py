"""Triton kernels: fused MoE experts on raw GGUF blocks."""
