"""`uring` reader (placeholder until the io_uring binding lands)."""

from __future__ import annotations


class UringUnavailable(RuntimeError):
    """io_uring cannot be used here; the message says why."""


class UringReader:
    name = "uring"

    def __init__(self, path: str, *, depth: int = 32, direct: bool = False):
        raise UringUnavailable("not implemented yet")
