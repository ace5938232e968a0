"""numba's on-disk cache, made to notice the sibling files a kernel file inlines code from.

numba keys a cached function on the hash of its own source file only. The expert kernels in
`rows.py` inline row decoders from sibling files (`rows_q.py`, `rows_iq.py`, `rows_base.py`): changed alone, such a
sibling would leave the cached kernels running its old decoders (and the decoders, which use
helpers of `rows.py`, the old helpers). `stamp_together(file, names)`, called before the
first `@njit(cache=True)` of any of them, makes the cache stamp of every function of `file` and
of its siblings `names` the hash of all of them, so a change to any one recompiles them all.

It hooks numba's (private) list of cache locators; where that list is missing (another numba),
nothing is hooked and numba's own behaviour stays.

`lazy_link_modules()` cuts what a kernel loaded from the cache holds. numba keeps, beside the
loaded machine code, the LLVM module of the kernel parsed from the cache's bitcode, in case a
later compile links a caller against it; a decoder whose kernels all come from the cache never
does. Each loaded kernel now keeps only the bitcode bytes and parses them if a link asks for the
module (a resident decode's peak RssAnon: see the function). Hooked likewise where numba has them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

_WATCHED: dict[str, tuple[str, ...]] = {}  # absolute source file -> the files its stamp covers


def _stamp(files: tuple[str, ...]) -> bytes:
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as f:
            h.update(f.read())
    return h.digest()


class _SiblingStampLocator:
    """A locator class that defers to numba's own and widens the stamp of watched files."""

    @classmethod
    def from_function(cls, py_func, py_file):  # numba's locator protocol
        from numba.core.caching import CacheImpl

        files = _WATCHED.get(os.path.abspath(py_file))
        if files is None:
            return None
        for base in CacheImpl._locator_classes:
            if base is cls:
                continue
            locator = base.from_function(py_func, py_file)
            if locator is not None:
                locator.get_source_stamp = lambda: _stamp(files)  # instance override
                return locator
        return None


def stamp_together(file: str, names: Sequence[str]) -> None:
    """Stamp the cached functions of `file` and of its siblings `names` (same folder) with the
    hash of all of them."""
    try:
        from numba.core.caching import CacheImpl

        locators = CacheImpl._locator_classes
    except (ImportError, AttributeError):
        return
    path = os.path.abspath(file)
    group = (path, *(os.path.join(os.path.dirname(path), n) for n in names))
    _WATCHED.update(dict.fromkeys(group, group))
    if _SiblingStampLocator not in locators:
        locators.insert(0, _SiblingStampLocator)


def lazy_link_modules() -> None:
    """Keep a cache-loaded kernel's link module as bitcode until a compile links against it.
    (peer16.gguf, `generate --resident -n 16`: peak RssAnon 280 -> 253 MiB, at the end 227 -> 203.)"""
    try:
        import llvmlite.binding as ll
        from numba.core.codegen import CPUCodeLibrary

        load = CPUCodeLibrary.__dict__["_unserialize"].__func__
        link = CPUCodeLibrary._get_module_for_linking
    except (ImportError, AttributeError, KeyError):
        return
    if getattr(link, "_lazy", False):
        return

    def unserialize(cls, codegen, state):
        lib = load(cls, codegen, state)
        _name, kind, data = state
        if kind == "object" and getattr(lib, "_shared_module", None) is not None:
            lib._shared_module.close()
            lib._shared_module, lib._link_bitcode = None, data[1]
        return lib

    def module_for_linking(self):
        bitcode = getattr(self, "_link_bitcode", None)
        if bitcode is not None and self._shared_module is None:
            self._shared_module = ll.parse_bitcode(bitcode)
        return link(self)

    module_for_linking._lazy = True
    CPUCodeLibrary._unserialize = classmethod(unserialize)
    CPUCodeLibrary._get_module_for_linking = module_for_linking
