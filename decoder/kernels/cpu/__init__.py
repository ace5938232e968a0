"""The CPU kernels (numba). Importing any of them first makes cache-loaded kernels keep their link
modules as bitcode (jit_cache.lazy_link_modules)."""

from .jit_cache import lazy_link_modules

lazy_link_modules()
