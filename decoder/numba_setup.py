"""numba's compiled CPU kernels, kept where this process can write them, and loaded before the
first request rather than during it.

numba caches `@njit(cache=True)` functions next to their source (`kernels/__pycache__`) or, if
that is not writable, in `~/.cache/numba`. A service user with a read-only install and no
writable home has neither: numba then refuses to define the kernels at all ("no locator
available"). `use_writable_cache()`, run when the decoder package is imported (before numba),
keeps numba's choice where the install is writable and otherwise sets NUMBA_CACHE_DIR to the
first writable of:

| where                              | who sets it                                             |
|------------------------------------|---------------------------------------------------------|
| $NUMBA_CACHE_DIR                   | the user, or the systemd unit (`Environment=`): kept    |
| $CACHE_DIRECTORY/numba             | systemd's `CacheDirectory=` (systemd/moestream-serve…)  |
| $XDG_CACHE_HOME/moestream/numba    | the user's cache home                                   |
| ~/.cache/moestream/numba           |                                                         |
| $TMPDIR/moestream-numba-UID        | last resort: survives until the temp dir is cleaned     |

`warm_kernels()` runs every kernel once on a tiny Q8_0 expert (one generic compile covers every
type: the row decoders dispatch on the type inside the kernel), so numba compiles them, or loads
them from the cache, while the model loads: a fresh process's first prefill then costs what a
warm one does. Without a cache it first says that it is compiling, how long that takes and where
it will keep the result. `python -m moestream.decoder.numba_setup` does it ahead (at install,
or in a unit's ExecStartPre=).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent / "kernels" / "cpu"
KERNEL_FILES = "rows*.nbi"  # numba's index files of the kernel modules


def _writable(path: Path) -> bool:
    """numba's own test: the directory can be made and a file created in it."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
        return True
    except OSError:
        return False


def choose_cache_dir(env: Mapping[str, str], kernels_dir: Path = KERNELS_DIR) -> Path | None:
    """The NUMBA_CACHE_DIR to set, or None to leave numba's own choice (the user's, or a
    writable install's `__pycache__`)."""
    if env.get("NUMBA_CACHE_DIR"):
        return None
    in_tree = kernels_dir / "__pycache__"
    if _writable(in_tree) if in_tree.exists() else _writable(kernels_dir):
        return None
    home = env.get("HOME")
    candidates = [Path(env["CACHE_DIRECTORY"].split(":")[0]) / "numba" if env.get("CACHE_DIRECTORY") else None,
                  Path(env["XDG_CACHE_HOME"]) / "moestream" / "numba" if env.get("XDG_CACHE_HOME") else None,
                  Path(home) / ".cache" / "moestream" / "numba" if home else None,
                  Path(env.get("TMPDIR") or tempfile.gettempdir()) / f"moestream-numba-{os.getuid()}"]
    for path in candidates:
        if path is not None and _writable(path):
            return path
    return None


def use_writable_cache() -> Path | None:
    """Set NUMBA_CACHE_DIR for this process where numba could not cache (see the module
    docstring); returns the directory set, or None."""
    path = choose_cache_dir(os.environ)
    if path is None:
        return None
    os.environ["NUMBA_CACHE_DIR"] = str(path)
    config = sys.modules.get("numba.core.config")
    if config is not None:  # numba already imported: its config was read from the environment then
        config.CACHE_DIR = str(path)
    return path


def cache_location() -> Path:
    """Where numba keeps (or will keep) the kernels' cache."""
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"])
    in_tree = KERNELS_DIR / "__pycache__"
    return in_tree if _writable(in_tree) else Path.home() / ".cache" / "numba"


def kernels_cached(where: Path | None = None) -> bool:
    """Whether numba's cache already holds kernel index files (they may still be stale: a
    changed source recompiles, which `warm_kernels` then reports by its time)."""
    where = where or cache_location()
    return where.is_dir() and next(where.rglob(KERNEL_FILES), None) is not None


def _say(text: str) -> None:
    print(f"moestream: {text}", file=sys.stderr, flush=True)


def warm_kernels(say: Callable[[str], None] = _say) -> float:
    """Compile (or load from the cache) every CPU kernel now; returns the seconds it took."""
    where = cache_location()
    if not kernels_cached(where):
        say(f"compiling the CPU kernels (once; 20-60 s on 2 cores), cached in {where} for the next start")
    t0 = time.perf_counter()
    _run_once()
    return time.perf_counter() - t0


def _run_once() -> None:
    """Every kernel on a tiny Q8_0 expert (d = ff = 32: one block per row, zeros decode to 0)."""
    import numpy as np

    from .kernels.cpu import ffn as cpu
    from .kernels.cpu import moe

    q8_0, d = 8, 32  # ggml type Q8_0: a block of 32 values in 34 bytes
    part = d * 34
    base = np.zeros(3 * part, np.uint8)
    gate, up, down = (cpu.QMatrix(base[i * part:(i + 1) * part], q8_0, d, d) for i in range(3))
    x = np.ones((1, d), np.float32)  # [1, d]
    cpu.swiglu_experts(x, cpu.expert_table(base, [(gate, up, down)]), [np.zeros(1, np.int64)])
    cpu.swiglu_expert(x, gate, up, down)
    cpu.linear(x, gate)
    cpu.dequantize(gate)
    routed = moe.Routed.of(np.zeros((1, 1), np.int64))
    routed.select([0])  # a streamed layer's arrival batch (moe.select_experts)
    rows, picks = routed.rows, routed.picks
    moe.weigh(x, np.ones(1, np.float32), picks)
    moe.scatter_add(np.zeros((1, d), np.float32), rows, x)
    cpu.rows_within(rows, 1)
    _run_step_kernels(x)


def _run_step_kernels(x) -> None:
    """The compiled steps of a CPU forward pass around the matrices (kernels/cpu/attention.py,
    the routing), with the argument types the model passes: one token of one 32-wide head."""
    import numpy as np

    from .kernels.cpu import attention as att
    from .kernels.cpu import moe

    att.rms_norm_rows(x, x[0], 1e-6)
    qkv, rope = np.ones((1, 96), np.float32), np.ones((1, 32), np.float32)  # [B, 3 hd], [B, hd]
    valid = np.ones((1, 1), np.bool_)
    for cache in (np.float32, np.int16):  # a float32 KV cache, or a float16 one as its int16 bits (--kv-dtype)
        kv = np.zeros((1, 1, 1, 32), cache)  # [B, Hkv, C, hd]
        for run in (att._decode_attention, att._decode_attention_par):
            run(qkv, 1, 1, 32, x[0], x[0], att.QK_HEAD, 1e-6, rope, rope, att.ROPE_NEOX, kv, kv.copy(), valid, 0,
                np.empty((1, 32), np.float32))
    moe.route(x[:, :8].copy(), 2, moe.ROUTE_SOFTMAX, True)


def main(argv: list[str] | None = None) -> int:
    """Compile the kernels into the cache now (at install, or before a service starts)."""
    seconds = warm_kernels()
    print(f"CPU kernels ready in {seconds:.1f} s; numba's cache: {cache_location()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
