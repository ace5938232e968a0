"""Decoder process: torch models whose experts come from moestream-iod or are resident."""

from .numba_setup import use_writable_cache

use_writable_cache()  # before numba is imported: a read-only install still caches its kernels
