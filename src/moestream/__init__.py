"""moestream: stream MoE experts from a GGUF file through a per-host I/O daemon."""

__version__ = "0.1.0"
