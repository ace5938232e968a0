"""Device slot cache: layouts, fills checked against gguf-py's dequantizer, pins, capacity."""

from __future__ import annotations

import random
import threading

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from moestream.common.layout import ExpertIndex, TensorInfo
from moestream.authoring.quantize import random_blocks
from moestream.decoder.experts.gpu.slot_cache import DeviceSlotCache, FetchFailed
from moestream.decoder.experts.gpu.slot_format import bytes_per_slot, slot_layouts, slots_for_bytes
from policy_check import CheckedPolicy

D, FF = 64, 32


class FakeFile:
    """An expert index over in-memory bytes: what the daemon's arena would hand us."""

    def __init__(self, qtype: Q, n_layer: int = 2, n_expert: int = 8, fused: bool = False, seed: int = 0):
        rng = np.random.default_rng(seed)
        d = ff = 256 if GGML_QUANT_SIZES[qtype][0] == 256 else None  # K-quants: rows of 256
        d, ff = d or D, ff or FF
        shapes = {"gate_up": (d, 2 * ff)} if fused else {"gate": (d, ff), "up": (d, ff)}
        shapes["down"] = (ff, d)
        chunks, off = [], 0
        self.index = ExpertIndex(n_layer, n_expert)
        for _ in range(n_layer):
            layer = []
            for name, (n_in, n_out) in shapes.items():
                block, size = GGML_QUANT_SIZES[qtype]
                raw = random_blocks(n_in * n_out * n_expert // block, qtype, 0.05, rng).reshape(-1)
                layer.append((name, TensorInfo(name, qtype, (n_in, n_out, n_expert), off, raw.size)))
                chunks.append(raw)
                off += raw.size
            self.index.tensors.append(layer)
        self.data = np.concatenate(chunks)

    def parts(self, layer: int, expert: int) -> dict[str, memoryview]:
        return {p.name: memoryview(self.data[p.offset:p.offset + p.nbytes]).toreadonly()
                for p in self.index.parts(layer, expert)}

    def reference(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """gate/up/down from gguf-py's numpy dequantizer (independent of ours)."""
        out = {}
        for p in self.index.parts(layer, expert):
            raw = self.data[p.offset:p.offset + p.nbytes].reshape(p.shape[1], -1)
            out[p.name] = torch.from_numpy(gguf_dequantize(raw, p.qtype).astype(np.float32))  # [n_out, n_in]
        if "gate_up" in out:
            out["gate"], out["up"] = out.pop("gate_up").chunk(2, dim=0)
        return out


def fill(cache: DeviceSlotCache, f: FakeFile, key: tuple[int, int]) -> int:
    slot = cache.claim(key)
    assert slot is not None
    cache.write(key, f.parts(*key))
    return slot


def assert_weights(cache: DeviceSlotCache, f: FakeFile, key: tuple[int, int]) -> None:
    w, ref = cache.weights(key), f.reference(*key)
    for name in ("gate", "up", "down"):
        assert torch.equal(getattr(w, name), ref[name]), (key, name)


def test_layout_aligns_parts_and_sizes_slots():
    f = FakeFile(Q.Q8_0)
    lay = slot_layouts(f.index)[0]
    assert [off % 64 for off, _ in lay.ranges.values()] == [0, 0, 0]
    assert [n for _, n in lay.ranges.values()] == [p.nbytes for p in f.index.parts(0, 0)]
    raw = bytes_per_slot(f.index)
    assert raw == lay.nbytes >= sum(p.nbytes for p in f.index.parts(0, 0))
    assert slots_for_bytes(f.index, 5 * raw + 1) == 5
    with pytest.raises(ValueError, match="smaller than one slot"):
        slots_for_bytes(f.index, raw - 1)


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_rejects_bad_slot_count(bad):
    with pytest.raises(ValueError, match="n_slots"):
        DeviceSlotCache(FakeFile(Q.F32).index, bad)


def test_rejects_bad_format_and_bad_parts():
    f = FakeFile(Q.F32)
    with pytest.raises(ValueError, match="n_slots"):
        DeviceSlotCache(f.index, 0)
    cache = DeviceSlotCache(f.index, 2)
    cache.claim((0, 1))
    parts = f.parts(0, 1)
    with pytest.raises(ValueError, match="part 'down' has 10 bytes"):
        cache.write((0, 1), {**parts, "down": b"x" * 10})
    assert (0, 1) not in cache  # a failed fill drops the entry
    with pytest.raises(ValueError, match="no slot waiting"):
        cache.write((0, 2), parts)


@pytest.mark.parametrize("qtype,fused", [(Q.F32, False), (Q.Q8_0, False), (Q.Q4_K, True)])
def test_fill_matches_gguf_reference(qtype, fused):
    f = FakeFile(qtype, fused=fused)
    cache = DeviceSlotCache(f.index, 3)
    for key in [(0, 0), (1, 7), (0, 0), (0, 5), (1, 2), (0, 0)]:  # 4 distinct keys through 3 slots
        if cache.pin_present(key[0], [key[1]])[0]:
            cache.wait(key)
        else:
            fill(cache, f, key)
        assert_weights(cache, f, key)
        cache.unpin(key)
        cache.check()
    assert cache.stats().evictions == 1 and cache.stats().hits == 2
    assert (1, 7) not in cache  # the coldest, oldest entry went


def test_never_evicts_pinned_and_reports_full():
    f = FakeFile(Q.Q8_0)
    cache = DeviceSlotCache(f.index, 2)
    fill(cache, f, (0, 0))
    fill(cache, f, (0, 1))  # both pinned by claim
    assert cache.claim((0, 2)) is None  # CacheFull: no overcommit
    cache.unpin((0, 1))
    assert fill(cache, f, (0, 2)) == cache.slot_of((0, 2))
    assert (0, 1) not in cache and (0, 0) in cache
    assert_weights(cache, f, (0, 0))


def test_bypass_weights_without_a_slot():
    f = FakeFile(Q.Q8_0)
    cache = DeviceSlotCache(f.index, 1)
    w, ref = cache.bypass_weights(1, f.parts(1, 3)), f.reference(1, 3)
    assert torch.equal(w.down, ref["down"]) and len(cache) == 0 and cache.bypassed == 1


def test_wait_blocks_until_another_thread_writes_and_abort_wakes_waiters():
    f = FakeFile(Q.Q8_0)
    cache = DeviceSlotCache(f.index, 4)
    cache.claim((0, 3))
    cache.claim((1, 3))
    assert (0, 3) in cache and cache.wait((0, 3), timeout=0.01) is False  # claimed, still filling
    writer = threading.Timer(0.05, lambda: cache.write((0, 3), f.parts(0, 3)))
    writer.start()
    assert cache.wait((0, 3), timeout=5.0) and cache.wait((0, 3), timeout=0)
    writer.join()
    assert_weights(cache, f, (0, 3))
    threading.Timer(0.05, lambda: cache.abort((1, 3))).start()
    with pytest.raises(FetchFailed, match=r"\(1, 3\)"):
        cache.wait((1, 3), timeout=5.0)
    assert (1, 3) not in cache
    cache.unpin((1, 3))  # a dropped key's pin is gone with it
    cache.check()


def test_long_random_decode_keeps_pins_and_capacity():
    """A random decode with prefetch-like in-flight claims: pinned contents never change."""
    f = FakeFile(Q.Q8_0, n_layer=4, n_expert=16, seed=1)
    policy = CheckedPolicy(8)
    cache = DeviceSlotCache(f.index, 8, policy=policy)
    rng = random.Random(0)
    refs = {(la, e): f.reference(la, e) for la in range(4) for e in range(16)}
    for step in range(150):
        cache.step()
        for layer in range(4):
            ahead = ((layer + 1) % 4, rng.randrange(16))  # a prediction for the next layer
            inflight = [ahead] if ahead not in cache and cache.claim(ahead) is not None else []
            held = []
            for e in rng.sample(range(16), 2):
                key = (layer, e)
                if cache.pin_present(key[0], [key[1]])[0]:
                    held.append(key)
                elif cache.claim(key) is not None:
                    cache.write(key, f.parts(*key))
                    held.append(key)
            for key in inflight:  # the "receiver" lands its copy while the layer holds its pins
                cache.write(key, f.parts(*key))
                cache.unpin(key)
            for key in held:
                cache.wait(key)
                w = cache.weights(key)
                assert torch.equal(w.down, refs[key]["down"]) and torch.equal(w.gate, refs[key]["gate"]), (step, key)
                cache.unpin(key)
            cache.check()
    assert policy.checked > 100 and policy.evicted > 50
    assert cache.stats().pinned == 0


def test_pin_present_counts_and_pins_under_one_call():
    cache = DeviceSlotCache(FakeFile(Q.Q8_0).index, 4)
    cache.claim((0, 1))
    cache.unpin((0, 1))
    present, missing = cache.pin_present(0, [1, 2])
    assert list(present) == [1] and missing == [2]
    assert cache.policy.pin_count((0, 1)) == 1 and cache.policy.hits == 1 and cache.policy.misses == 1
    cache.release_many(0, [1])
    assert cache.policy.pin_count((0, 1)) == 0
    cache.check()


def test_an_entry_is_filling_then_ready_then_failed():
    f = FakeFile(Q.Q8_0)
    cache = DeviceSlotCache(f.index, 2)
    cache.claim((0, 1))
    entry = cache.pin_present(0, [1])[0][1]
    assert cache.ready_weights(0, entry) is None and not cache.wait((0, 1), timeout=0)  # filling
    cache.write((0, 1), f.parts(0, 1))
    assert torch.equal(cache.ready_weights(0, entry).down, f.reference(0, 1)["down"])  # ready
    with pytest.raises(ValueError, match="no slot waiting"):
        cache.write((0, 1), f.parts(0, 1))  # a ready entry is not filled twice
    cache.abort((0, 1))
    assert cache.ready_weights(0, entry) is None and (0, 1) not in cache  # failed: dropped with its pins
    assert cache.pinned() == 0
    cache.check()
