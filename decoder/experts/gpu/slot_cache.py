"""The device slot cache: a fixed number of expert slots on the compute device.

The bookkeeping is a pure `slot_book.SlotBook`: `(layer, expert) -> slot` (evictions chosen by
`common.policy.SlotPolicy`: hotness-decayed LFU, LRU tiebreak, never a pinned entry), each
entry FILLING (`claim`), then READY (`write`) or FAILED (`abort`: dropped, its waiters get
FetchFailed), its pins counted per named owner: `fill` (an eager prefetch's bytes in flight),
`hold` (a prefetch kept for its layer), `layer` (a layer computing with it; a demand miss's
claim is the layer's). When every slot is pinned, `claim` returns None: the caller waits or
bypasses the cache, it never overcommits. This class keeps the device memory and the threading.

A slot holds an expert's quantized blocks (`slot_format`: layout and sizes). With the fused
Triton kernels (`kernels`, on CUDA by default), a hit is a `SlotRef` (the slot's index, nothing dequantized) and the kernels read the slot
memory itself; an expert served without a slot goes to a `spare` row (index n_slots + i).

Delivery on CUDA: the daemon's arena mapping is registered with CUDA once (`register_host`,
read-only `cudaHostRegister`), so a part is copied arena -> device slot by one async copy on
the side stream, with no host copy; `write` returns (and the caller releases the lease) when
that copy's event has fired. Where registration fails, parts go through a pinned staging buffer.

Thread-safety: the compute thread and the prefetch receiver thread both call in; one lock
guards the policy and the maps, bytes are copied outside it. On CUDA, copies run on a side
stream: a slot's fill records an event the compute stream waits on (`wait`), and the compute
stream's last use of a slot (`release_many`) is an event the side stream waits on before it
overwrites the slot, since the host unpins before the GPU has finished reading.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Hashable, Mapping
from typing import Any

import torch

from ....common.layout import ExpertIndex
from ....common.policy import SlotPolicy
from ..slot_book import BookEntry, SlotBook, SlotState
from ..source import ExpertWeights, blob_to_weights
from ..stats import CacheStats
from .slot_format import SlotLayout, check_parts, pack_parts, slot_kernels, slot_layouts

Key = tuple[int, int]  # (layer, expert)


class FetchFailed(RuntimeError):
    """The bytes for an entry never arrived (read error, daemon gone); the entry was dropped."""


class SlotRef:
    """A raw slot the fused kernels read in place: index into blobs (>= n_slots: a spare row)."""

    __slots__ = ("slot",)

    def __init__(self, slot: int) -> None:
        self.slot = slot


class Fill:
    """The storage side of a book entry (`BookEntry.data`): set once the entry leaves FILLING
    (threads wait on it), and the CUDA event recorded after its copies."""

    __slots__ = ("event", "settled")

    def __init__(self) -> None:
        self.event: Any = None
        self.settled = threading.Event()


class DeviceSlotCache:
    """Expert slots on `device`; see `slot_format` for a slot's layout, the module docstring for
    threading. `dtype`: the float type experts are dequantized to where no fused kernel runs."""

    def __init__(self, index: ExpertIndex, n_slots: int, device: torch.device | str = "cpu", *,
                 dtype: torch.dtype = torch.float32, decay: float = 0.9, policy: SlotPolicy | None = None,
                 kernels: bool | None = None, act: str = "swiglu") -> None:
        self.device = torch.device(device)
        if isinstance(n_slots, bool) or not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"the device slot cache needs n_slots >= 1, got {n_slots!r}")
        self.n_slots, self.dtype, self.n_expert = n_slots, dtype, index.n_expert
        self.layouts = slot_layouts(index)
        self.slot_bytes = max(lay.nbytes for lay in self.layouts)
        self.policy = policy if policy is not None else SlotPolicy(n_slots, decay)
        if self.policy.capacity != n_slots:
            raise ValueError(f"policy capacity {self.policy.capacity} != n_slots {n_slots}")
        self._lock = threading.Lock()
        self.book = SlotBook(self.policy)  # under `_lock`
        self._cuda = self.device.type == "cuda"
        self._side = torch.cuda.Stream(self.device) if self._cuda else None
        self._last_use: dict[int, Any] = {}  # slot -> CUDA event of the compute stream's last read
        self._staging: list[tuple[torch.Tensor, Any]] = []  # free host buffers (+ event of last H2D copy)
        self.writes = self.bytes_written = self.bypassed = self.direct_copies = 0
        self.blobs = torch.zeros(n_slots, self.slot_bytes, dtype=torch.uint8, device=self.device)  # [n_slots, slot_bytes]
        self.spare = torch.zeros(1, self.slot_bytes, dtype=torch.uint8, device=self.device)  # [n_spare, slot_bytes]
        self.kernels = slot_kernels(self.layouts, self.device, kernels, act)
        self._spare_used = 0  # spare rows handed out in the current layer
        self._registered: list[tuple[int, torch.Tensor]] = []  # host mappings registered with CUDA (address, bytes)

    @property
    def nbytes(self) -> int:
        """Device bytes the slots take."""
        return self.blobs.numel()

    # -- queries ---------------------------------------------------------------------------
    def __contains__(self, key: Hashable) -> bool:
        with self._lock:
            return key in self.book

    def __len__(self) -> int:
        with self._lock:
            return len(self.book)

    def slot_of(self, key: Key) -> int | None:
        with self._lock:
            entry = self.book.get(key)
            return None if entry is None else entry.slot

    def stats(self) -> CacheStats:
        with self._lock:
            policy = self.policy.stats()
        return CacheStats(**policy, device=str(self.device), slot_bytes=self.slot_bytes, cache_bytes=self.nbytes,
                          writes=self.writes, bytes_written=self.bytes_written, bypassed=self.bypassed,
                          direct_copies=self.direct_copies, host_registered=bool(self._registered),
                          kernels="triton" if self.kernels is not None else "torch")

    # -- pins and accesses -----------------------------------------------------------------
    def pin_present(self, layer: int, experts: list[int]) -> tuple[dict[int, BookEntry], list[int]]:
        """One layer's lookups under one lock: each resident expert counts a hit and is pinned
        for the layer (returned with its entry), each absent one counts a miss (in the list)."""
        present, missing = {}, []
        with self._lock:
            for e in experts:
                entry = self.book.lookup((layer, e), "layer")
                if entry is None:
                    missing.append(e)
                else:
                    present[e] = entry
        return present, missing

    def release_many(self, layer: int, experts: list[int]) -> None:
        """The layer's compute is enqueued: drop one pin per expert under one lock. On CUDA the
        compute stream's last read of their slots is one event, which a refill waits for."""
        event = None
        if self._cuda and experts:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        with self._lock:
            for e in experts:
                entry = self.book.get((layer, e))
                if entry is not None:
                    if event is not None:
                        self._last_use[entry.slot] = event
                    self.book.unpin((layer, e), "layer")

    def pin(self, key: Key, owner: str = "layer") -> None:
        """One more pin of `owner` on a resident key (raises KeyError when absent)."""
        with self._lock:
            self.book.pin(key, owner)

    def pinned(self) -> int:
        """How many entries hold at least one pin."""
        with self._lock:
            return self.book.pinned

    def unpin(self, key: Key, owner: str = "layer") -> None:
        """Drop one of `owner`'s pins; a key already dropped by `abort` is ignored."""
        with self._lock:
            self.book.unpin(key, owner)

    def step(self) -> None:
        """One decode step: the policy's decay tick."""
        with self._lock:
            self.policy.step()

    def claim(self, key: Key, owner: str = "layer") -> int | None:
        """Give `key` a slot, FILLING and pinned for `owner` (the layer that fetches it on demand,
        or `fill` for a prefetch the receiver lands); None when every slot is pinned."""
        with self._lock:
            entry = self.book.claim(key, owner, Fill())
        return None if entry is None else entry.slot

    def abort(self, key: Key) -> None:
        """The fill of `key` failed: drop it and wake its waiters with FetchFailed."""
        with self._lock:
            entry = self.book.fail(key)
        if entry is not None:
            entry.data.settled.set()

    # -- bytes in --------------------------------------------------------------------------
    def write(self, key: Key, parts: Mapping[str, Any]) -> None:
        """Copy an expert's parts (host buffers, e.g. arena memoryviews) into its claimed slot.

        Returns once the host buffers are no longer needed (the caller may release its lease);
        on CUDA the device copy may still be running on the side stream. Marks the entry READY.
        """
        with self._lock:
            entry = self.book.get(key)
        if entry is None or entry.state is not SlotState.FILLING:
            raise ValueError(f"expert {key} has no slot waiting for bytes")
        lay = self.layouts[key[0]]
        try:
            check_parts(key, lay, parts)
            entry.data.event = self._fill(entry.slot, lay, parts)
        except BaseException:
            self.abort(key)
            raise
        with self._lock:
            self.writes += 1
            self.bytes_written += sum(n for _, n in lay.ranges.values())
            ready = self.book.ready(key, entry) is not None  # an `abort` meanwhile keeps it FAILED
        if ready:
            entry.data.settled.set()

    def _fill(self, slot: int, lay: SlotLayout, parts: Mapping[str, Any]) -> Any:
        if not self._cuda:
            row = self.blobs[slot].numpy()  # writable view of the slot: one memcpy per part
            pack_parts(row, lay, parts)
            return None
        direct = self._registered_parts(parts) if self._registered else None
        if direct is not None:
            return self._copy_direct(slot, lay, direct)
        staging, event = self._take_staging(), None
        try:
            pack_parts(staging.numpy(), lay, parts)
            event = self._upload(slot, lay, staging)
            return event
        finally:
            self._give_staging(staging, event)

    def _upload(self, slot: int, lay: SlotLayout, staging: torch.Tensor) -> Any:
        """Pinned host staging bytes -> slot, on the side stream (CUDA)."""
        with torch.cuda.stream(self._side):
            last = self._last_use.get(slot)
            if last is not None:
                self._side.wait_event(last)  # compute may still read the old contents
            self.blobs[slot, :lay.nbytes].copy_(staging[:lay.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._side)
        return event

    def _copy_direct(self, slot: int, lay: SlotLayout, parts: Mapping[str, torch.Tensor]) -> Any:
        """Registered arena -> device slot: one async copy per part on the side stream; returns
        once the copies are done (the caller then releases the lease), with their event."""
        with torch.cuda.stream(self._side):
            last = self._last_use.get(slot)
            if last is not None:
                self._side.wait_event(last)  # compute may still read the old contents
            for name, (off, n) in lay.ranges.items():
                self.blobs[slot, off:off + n].copy_(parts[name], non_blocking=True)  # DMA from the arena
            event = torch.cuda.Event()
            event.record(self._side)
        event.synchronize()  # the lease may go back only when the arena bytes have been read
        with self._lock:  # the receiver thread copies too
            self.direct_copies += 1
        return event

    def _take_staging(self) -> torch.Tensor:
        """A host buffer of one slot (pinned on CUDA), from a small free list."""
        with self._lock:
            item = self._staging.pop() if self._staging else None
        if item is None:
            return torch.empty(self.slot_bytes, dtype=torch.uint8, pin_memory=self._cuda)  # [slot_bytes]
        buf, event = item
        if event is not None:
            event.synchronize()  # its last H2D copy must be done before we overwrite it
        return buf

    def _give_staging(self, buf: torch.Tensor, event: Any) -> None:
        with self._lock:
            self._staging.append((buf, event))

    # -- bytes out -------------------------------------------------------------------------
    def wait(self, key: Key, timeout: float | None = None) -> bool:
        """Block until `key` is ready; False on timeout. Raises FetchFailed when its fill failed.

        On CUDA the current (compute) stream is made to wait for the slot's copy, not the host.
        """
        with self._lock:
            entry = self.book.get(key)
        if entry is None:
            raise FetchFailed(f"expert {key} is not in the device slot cache")
        if not entry.data.settled.wait(timeout):
            return False
        if entry.state is SlotState.FAILED:
            raise FetchFailed(f"expert {key}: its bytes never arrived")
        if entry.data.event is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.data.event)
        return True

    def weights(self, key: Key) -> ExpertWeights:
        """The expert's weights from its (ready, pinned) slot."""
        with self._lock:
            entry = self.book.get(key)
        if entry is None:
            raise KeyError(f"expert {key} is not in the device slot cache")
        return self._weights_at(key[0], entry.slot)

    def ready_weights(self, layer: int, entry: BookEntry) -> ExpertWeights | None:
        """The hit path: weights of a pinned entry whose bytes are in, else None (use `wait`)."""
        if not entry.ready:
            return None
        if entry.data.event is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.data.event)
        return self._weights_at(layer, entry.slot)

    def fused(self, layer: int) -> bool:
        """Whether `layer` is computed by the fused kernels on the slots (hits are `SlotRef`s)."""
        return self.kernels is not None and self.kernels.supports(layer)

    def _weights_at(self, layer: int, slot: int) -> Any:
        if self.fused(layer):
            return SlotRef(slot)
        lay = self.layouts[layer]
        return blob_to_weights(list(lay.parts), self.blobs[slot], lay.ranges, self.dtype)

    def bypass_weights(self, layer: int, parts: Mapping[str, Any]) -> ExpertWeights:
        """Weights straight from host buffers, without a slot (the fallback when all are pinned)."""
        lay = self.layouts[layer]
        check_parts((layer, -1), lay, parts)
        buf = torch.empty(lay.nbytes, dtype=torch.uint8)  # [nbytes] host
        pack_parts(buf.numpy(), lay, parts)
        self.bypassed += 1
        if self.fused(layer):
            return self._to_spare(buf)
        return blob_to_weights(list(lay.parts), buf.to(self.device), lay.ranges, self.dtype)

    def begin_layer(self) -> None:
        """A layer's acquire starts: the spare rows of the last one are free again (on CUDA its
        kernels, queued on the same stream, read them before anything new is copied in)."""
        self._spare_used = 0

    def _to_spare(self, buf: torch.Tensor) -> SlotRef:
        i = self._spare_used
        if i >= self.spare.shape[0]:  # grow: the old rows stay alive until queued kernels are done
            grown = torch.zeros(2 * self.spare.shape[0], self.slot_bytes, dtype=torch.uint8, device=self.device)
            grown[:i].copy_(self.spare[:i])
            self.spare = grown  # [n_spare, slot_bytes]
        self.spare[i, :buf.numel()].copy_(buf)  # on the compute stream, before the layer's kernels
        self._spare_used += 1
        return SlotRef(self.n_slots + i)

    def slot_row(self, layer: int, refs: Mapping[int, SlotRef]) -> torch.Tensor:
        """The layer's expert -> slot map as a device tensor int32 [n_expert] (-1: not acquired),
        from the refs `acquire` returned: one small host -> device copy per layer."""
        # pinned on CUDA: an async copy from the caching host allocator, which keeps the buffer
        # until the copy is done; a pageable copy would wait for the whole queued stream
        row = torch.empty(self.n_expert, dtype=torch.int32, pin_memory=self._cuda)  # [n_expert]
        row.fill_(-1)
        for e, ref in refs.items():
            row[e] = ref.slot
        return row.to(self.device, non_blocking=True)

    # -- pinned delivery (CUDA) --------------------------------------------------------------
    def register_host(self, view: Any) -> bool:
        """Register a host mapping (the daemon's arena, read-only) with CUDA so parts inside it
        are copied straight to their slot; False (and the staging path) where that fails."""
        if not self._cuda:
            return False
        start, n = _address(view), memoryview(view).nbytes
        if any(a == start for a, _ in self._registered):
            return True
        if not _cuda_host_register(start, n):
            return False
        with warnings.catch_warnings():  # read-only on purpose: copies only read it
            warnings.simplefilter("ignore", UserWarning)
            whole = torch.frombuffer(view, dtype=torch.uint8)  # [n] the mapping as a CPU tensor, no copy
        self._registered = [*self._registered, (start, whole)]  # copy on write: fills read it unlocked
        return True

    def unregister_host(self) -> None:
        """Undo `register_host` (before the mapping is unmapped)."""
        old, self._registered = self._registered, []
        if old and self._side is not None:
            self._side.synchronize()  # copies out of the old mapping are done
        for start, _ in old:
            _cuda_host_unregister(start)

    def _registered_parts(self, parts: Mapping[str, Any]) -> dict[str, torch.Tensor] | None:
        """{part: CPU tensor over its bytes in a registered mapping}, or None if one lies outside."""
        out = {}
        registered = self._registered
        for name, view in parts.items():
            a, n = _address(view), memoryview(view).nbytes
            for start, whole in registered:
                if start <= a and a + n <= start + whole.numel():
                    out[name] = whole[a - start:a - start + n]  # [n]
                    break
            else:
                return None
        return out

    # -- checks ----------------------------------------------------------------------------
    def check(self) -> None:
        """Assert internal invariants (used by tests after every operation)."""
        with self._lock:
            self.book.check()


def _address(view: Any) -> int:
    """First byte's address of a buffer (read-only ones too)."""
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])


_HOST_REGISTER_READ_ONLY = 0x08  # cudaHostRegisterReadOnly: the arena is mapped PROT_READ


def _cudart() -> Any:
    """libcudart through ctypes: the copy torch already loaded (dlopen by soname returns it), or
    None. (torch.cuda.cudart()'s binding is the fallback; ctypes can also clear a failed call's
    error, which torch would otherwise report at its next kernel launch.)"""
    import ctypes

    try:
        with open("/proc/self/maps") as f:
            loaded = [line.split()[-1] for line in f if "libcudart.so" in line]
    except OSError:
        loaded = []
    major = (torch.version.cuda or "").split(".")[0]
    for name in (*loaded[:1], *([f"libcudart.so.{major}"] if major else [])):
        try:
            lib = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        return lib
    return None


def _cuda_host_register(addr: int, nbytes: int) -> bool:
    """cudaHostRegister(addr, nbytes, ReadOnly); False on failure (the caller stages instead)."""
    lib = _cudart()
    try:
        if lib is not None:
            err = lib.cudaHostRegister(addr, nbytes, _HOST_REGISTER_READ_ONLY)
            if err:
                lib.cudaGetLastError()  # clear it: the fallback is not an error
            return err == 0
        return int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, _HOST_REGISTER_READ_ONLY)) == 0
    except Exception:  # no binding in this build
        return False


def _cuda_host_unregister(addr: int) -> None:
    lib = _cudart()
    try:
        if lib is not None:
            if lib.cudaHostUnregister(addr):
                lib.cudaGetLastError()
        else:
            torch.cuda.cudart().cudaHostUnregister(addr)
    except Exception:
        pass
