"""Torch dequantizers of raw GGUF blocks, on any device."""
