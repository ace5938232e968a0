"""Kernels that compute on raw GGUF blocks: numba (CPU), Triton (GPU), torch dequantizers."""
