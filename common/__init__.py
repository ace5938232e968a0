"""The contract between the daemon and decoders: GGUF layout, wire protocol, arena, policy.

Nothing here imports torch or opens a socket at import time.
"""
