"""Explicit SIMD vectors (LLVM IR) for the numba kernels."""
