"""Zero-copy GPU experts (`--gpu-experts arena`): the Triton kernels read leased arena slots in
place, through the arena's CUDA-registered mapping. No device slot cache: the daemon's arena is
the GPU's expert cache too, under the one memory budget a CPU decoder has.

On a unified-memory machine (GB10, GH200: CPU and GPU share one pool) this is the fast path, since
a device copy of an expert would be the same memory twice; on a discrete GPU it is the low-VRAM
fallback (every weight crosses PCIe each time it is read).

For each layer, `ArenaGpuExperts.mix`:
1. takes the routed ids to the host (the layer's one sync) and lists the wanted experts;
2. finds those whose lease it still holds (leases are kept across tokens, a least recently used
   one handed back once `keep` are held, any the daemon recalls handed back at the next layer),
   fetches the others `now` in one message and waits for them;
3. writes the layer's slot map and part offsets (where each expert's gate, up and down start in
   its slot: they differ between experts with O_DIRECT reads) where they changed;
4. runs the fused kernels (`kernels.gpu.experts.SlotKernels`) on the arena mapping: the same kernels
   and summation order as the device slot cache and resident raw slots, so streamed == resident
   bit for bit.
A lease goes back only after the GPU has finished reading it (the event of its last use). A
daemon restart voids every lease: they are fetched again from the new daemon's arena, which is
mapped in turn.

Under the Triton interpreter (tests on a CPU) the mapping is the arena as a CPU tensor.
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from ....common.arena import ArenaView
from ....common.client import IodClient, IodUnavailable, Lease
from ....common.layout import ModelLayout
from .slot_format import slot_layouts
from ..leases import LeasePipeline
from ..source import ExpertBackend
from ..stats import ZeroCopyStats

Key = tuple[int, int]  # (layer, expert)


@dataclass
class _Held:
    lease: Lease
    used: Any = None  # CUDA event of the last kernel that read it (None: nothing in flight)


class _Mapping:
    """One arena as the kernels' `blobs [n_slots, slot_bytes]`: registered with CUDA and viewed
    at its device address (the host address under unified virtual addressing), or a CPU tensor
    under the interpreter."""

    def __init__(self, arena: ArenaView, device: torch.device):
        self.arena, self.device = arena, device
        view = arena.whole()
        self.addr = int(np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0])
        self.registered = False
        if device.type == "cuda":
            from .slot_cache import _cuda_host_register

            if not _cuda_host_register(self.addr, view.nbytes):
                raise RuntimeError("cannot register the daemon's arena with CUDA (cudaHostRegister failed): "
                                   "use --gpu-experts slots")
            self.registered = True
            self.blobs = torch.as_tensor(_DeviceArray(self.addr, (arena.n_slots, arena.slot_bytes)), device=device)
        else:
            with warnings.catch_warnings():  # read-only on purpose: the kernels only read it
                warnings.simplefilter("ignore", UserWarning)
                self.blobs = torch.frombuffer(view, dtype=torch.uint8).view(arena.n_slots, arena.slot_bytes)

    def close(self) -> None:
        if self.registered:
            from .slot_cache import _cuda_host_unregister

            torch.cuda.synchronize(self.device)  # nothing reads it any more
            _cuda_host_unregister(self.addr)
            self.registered = False
        self.blobs = None


class _DeviceArray:
    """A device pointer with a shape, for `torch.as_tensor` (the CUDA array interface)."""

    def __init__(self, addr: int, shape: tuple[int, int]):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": "|u1", "data": (addr, True), "version": 3,
                                         "strides": None}


class ArenaGpuExperts(ExpertBackend):
    """Experts computed on the GPU from leased arena slots in place (see the module docstring)."""

    kind = "gpu-arena"

    def __init__(self, client: IodClient, layout: ModelLayout, device: torch.device | str, *,
                 keep: int | None = None, fetch_timeout_s: float = 60.0, owns_client: bool = False):
        from ...kernels.gpu.experts import SlotKernels, available

        self.client, self.layout, self.device = client, layout, torch.device(device)
        if not available(self.device):
            raise ValueError("zero-copy experts run the Triton kernels: they need CUDA (or TRITON_INTERPRET=1)")
        if layout.spec.expert_act != "swiglu":
            raise ValueError(f"zero-copy experts do not support {layout.arch_name}'s experts "
                             f"({layout.spec.expert_act}, with biases) yet: use --gpu-experts slots")
        self.kernels = SlotKernels(slot_layouts(layout.experts), self.device)
        bad = [layer for layer in layout.experts.moe_layers if not self.kernels.supports(layer)]
        if bad:
            raise ValueError(f"zero-copy experts: layers {bad[:4]} have expert types without a fused kernel")
        self._owns_client = owns_client
        ex = layout.experts
        n_slots = client.arena.n_slots if client.arena is not None else 0
        share = min(n_slots, client.lease_quota or n_slots)
        self.keep = keep if keep is not None else max(layout.hparams.n_expert_used, share // 2)
        self._held: OrderedDict[Key, _Held] = OrderedDict()  # least recently used first
        self._slot_map = torch.zeros(ex.n_layer, ex.n_expert, dtype=torch.int32, device=self.device)  # [L, E]
        self._offs = torch.zeros(ex.n_layer, ex.n_expert, 3, dtype=torch.int64, device=self.device)  # [L, E, 3]
        self._written: dict[Key, tuple[int, int]] = {}  # what the device tables hold: key -> (slot, epoch)
        self._spare = torch.zeros(1, 1, dtype=torch.uint8, device=self.device)  # never indexed: no spare rows
        self._mapping: _Mapping | None = None
        self.counts = ZeroCopyStats(keep=self.keep, held=0)
        self.leases = LeasePipeline(client, self.counts, fetch_timeout_s)
        self._closed = False

    # -- ExpertBackend -----------------------------------------------------------------------
    def begin_step(self) -> None:
        self.leases.begin_step()

    def mix(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self._hand_back_recalled()
        wanted = sorted(set(ids.reshape(-1).tolist()))  # the layer's one host sync
        leases = self._hold(layer, wanted)
        mapping = self._mapping_for(leases)
        self._write_tables(layer, leases)
        out = self.kernels.mix(layer, mapping.blobs, self._spare, self._slot_map[layer], x, weights, ids,
                               self._offs[layer])
        used = torch.cuda.Event() if self.device.type == "cuda" else None
        if used is not None:
            used.record()
        for e in wanted:
            self._held[(layer, e)].used = used
        self._trim(layer)
        self.counts.acquired += len(wanted)
        return out

    def stats(self) -> ZeroCopyStats:
        return replace(self.counts, held=len(self._held))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._release([self._held.pop(k) for k in list(self._held)])
        except IodUnavailable:
            pass  # the daemon is gone, and our leases with it
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None
        if self._owns_client:
            self.client.close()

    # -- leases --------------------------------------------------------------------------------
    def _hold(self, layer: int, wanted: list[int]) -> dict[int, Lease]:
        """A held, valid lease for every wanted expert (fetched `now` where none is held)."""
        got: dict[int, Lease] = {}
        missing = []
        for e in wanted:
            h = self._held.get((layer, e))
            if h is not None and self.client.voided(h.lease):  # a lost daemon's (or revoked): ask again
                del self._held[(layer, e)]
                self.counts.voided += 1
                h = None
            if h is None:
                missing.append(e)
            else:
                self._held.move_to_end((layer, e))
                got[e] = h.lease
                self.counts.held_hits += 1
        if missing:
            if len(wanted) > self.keep:
                raise IodUnavailable(f"layer {layer} routes to {len(wanted)} experts, more than the {self.keep} leases "
                                     "this decoder keeps (its share of the arena): give the daemon a larger arena")
            self._trim(layer, room=len(missing))  # our own held leases must not keep our demand waiting
            got.update(self._fetch_now(layer, missing))
        return got

    def _fetch_now(self, layer: int, experts: list[int]) -> dict[int, Lease]:
        """One `fetch now` for `experts` through the lease pipeline (retries, void leases)."""
        owed = self.leases.request(layer, experts)
        out: dict[int, Lease] = {}
        try:
            for leases in self.leases.arrivals(owed):
                for e, lease in leases.items():
                    self._held[(layer, e)] = _Held(lease)
                    out[e] = lease
        except BaseException:
            self.leases.give_up(owed)
            raise
        return out

    def _trim(self, keep_layer: int, room: int = 0) -> None:
        """Hand back the least recently used leases past `keep` less `room` (never `keep_layer`'s)."""
        over = len(self._held) + room - self.keep
        if over <= 0:
            return
        drop = [k for k in self._held if k[0] != keep_layer][:over]
        self._release([self._held.pop(k) for k in drop])

    def _hand_back_recalled(self) -> None:
        recalled = self.client.take_recalled()
        if not recalled:
            return
        back = [k for k, h in self._held.items() if (h.lease.slot, h.lease.generation) in recalled]
        self.counts.recalled += len(back)
        self._release([self._held.pop(k) for k in back])

    def _release(self, held: list[_Held]) -> None:
        """Hand leases back once the GPU has finished reading them."""
        for h in held:
            if h.used is not None:
                h.used.synchronize()
        self.client.release_many([h.lease for h in held])
        self.counts.released += len(held)

    # -- device tables and the mapping --------------------------------------------------------
    def _mapping_for(self, leases: dict[int, Lease]) -> _Mapping:
        """The mapping of the arena these leases live in (a reconnect brings a new arena)."""
        arena = self.client.arena_of(next(iter(leases.values()))) if leases else self.client.arena
        if self._mapping is None or self._mapping.arena is not arena:
            if self._mapping is not None:
                self._mapping.close()
            self._mapping = _Mapping(arena, self.device)
            self._written.clear()
        return self._mapping

    def _write_tables(self, layer: int, leases: dict[int, Lease]) -> None:
        """Slot and part offsets of each leased expert, on the device where they changed."""
        epoch = self.client.epoch
        changed = [(e, lease) for e, lease in leases.items() if self._written.get((layer, e)) != (lease.slot, epoch)]
        if not changed:
            return
        es = torch.tensor([e for e, _ in changed])  # [n]
        slots = torch.tensor([lease.slot for _, lease in changed], dtype=torch.int32)  # [n]
        offs = torch.tensor([self._part_offsets(lease) for _, lease in changed], dtype=torch.int64)  # [n, 3]
        self._slot_map[layer, es.to(self.device)] = slots.to(self.device)
        self._offs[layer, es.to(self.device)] = offs.to(self.device)
        for e, lease in changed:
            self._written[(layer, e)] = (lease.slot, epoch)

    def _part_offsets(self, lease: Lease) -> tuple[int, int, int]:
        """(gate, up, down) byte offsets inside the slot; a fused gate_up holds gate's rows first."""
        parts = lease.parts
        if "gate_up" in parts:
            off, n = parts["gate_up"]
            return off, off + n // 2, parts["down"][0]
        return parts["gate"][0], parts["up"][0], parts["down"][0]


def open_arena_gpu(layout: ModelLayout, endpoint: str, device: torch.device | str, *, timeout_s: float = 5.0,
                   fetch_timeout_s: float = 60.0, name: str | None = None, reconnect_s: float = 30.0,
                   keep: int | None = None) -> ArenaGpuExperts:
    """Connect to the daemon at `endpoint` and compute its experts in place on `device`."""
    client = IodClient(endpoint, expect_fingerprint=layout.fingerprint.as_dict(), timeout_s=timeout_s, name=name,
                       reconnect_s=reconnect_s)
    try:
        return ArenaGpuExperts(client, layout, device, keep=keep, fetch_timeout_s=fetch_timeout_s, owns_client=True)
    except BaseException:
        client.close()
        raise
