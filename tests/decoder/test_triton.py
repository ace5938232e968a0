"""The Triton expert kernels against an independent reference: gguf-py's numpy dequantizer and
float64 math. Without CUDA they run under Triton's interpreter (TRITON_INTERPRET=1, numpy on the
CPU: small shapes); with CUDA, on the device. A last test compiles every kernel for sm_90 (no
GPU needed): what the interpreter accepts, the compiler must too.

Tolerance of the expert mix: max |kernel - reference| <= RTOL * max |reference| (float32 sums,
reassociated; the reference sums in float64 on the same decoded weights).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are defined (first import)

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize

triton = pytest.importorskip("triton")

from moestream.decoder.experts.bank import ExpertBank
from moestream.decoder.generation.loop import forward_step
from moestream.common.layout import ExpertIndex, TensorInfo
from moestream.decoder.kernels.gpu import experts as tx
from moestream.decoder.kernels.gpu import quant as tq
from moestream.decoder.experts.gpu.slot_format import slot_layouts

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANTS = tuple(q for q in tq.KERNEL_TYPES if q not in (Q.F32, Q.F16, Q.BF16))
NO_KERNEL = Q.Q8_1  # a ggml type without a Triton decoder (no weights ship in it)
RTOL = 2e-5
N_EXPERT, N_SLOTS = 6, 4  # experts 4 and 5 sit in the spare rows (served without a slot)


class Bank:
    """One layer of experts in a slot store: blobs [N_SLOTS, slot_bytes] + spare rows, as the
    device slot cache lays them out (`slot_layouts`), and their gguf-py reference matrices."""

    def __init__(self, qtypes: tuple[Q, Q], d: int, ff: int, fused: bool = False, seed: int = 0):
        rng = np.random.default_rng(seed)
        qa, qd = qtypes
        shapes = [("gate_up", qa, (d, 2 * ff))] if fused else [("gate", qa, (d, ff)), ("up", qa, (d, ff))]
        shapes.append(("down", qd, (ff, d)))
        self.index = ExpertIndex(1, N_EXPERT)
        self.index.tensors.append([(name, TensorInfo(name, q, (*shape, N_EXPERT), 0, nbytes(q, shape) * N_EXPERT))
                                   for name, q, shape in shapes])
        self.lay = slot_layouts(self.index)[0]
        store = np.zeros((N_EXPERT, self.lay.nbytes), np.uint8)
        self.ref = []
        for e in range(N_EXPERT):
            mats = {}
            for name, q, (n_in, n_out) in shapes:
                raw = tq.random_blocks(int(q), n_out, n_in, rng)
                off, n = self.lay.ranges[name]
                store[e, off:off + n] = raw
                mats[name] = reference_dequant(raw, q, n_out, n_in).astype(np.float64)  # [n_out, n_in]
            if fused:
                mats["gate"], mats["up"] = np.split(mats.pop("gate_up"), 2)
            self.ref.append(mats)
        # expert e -> slot: a permutation, experts 4 and 5 past the cache (spare rows 0 and 1)
        self.slot_of = [2, 0, 3, 1, N_SLOTS, N_SLOTS + 1]
        self.blobs = torch.zeros(N_SLOTS, self.lay.nbytes, dtype=torch.uint8)  # [n_slots, slot_bytes]
        self.spare = torch.zeros(2, self.lay.nbytes, dtype=torch.uint8)  # [2, slot_bytes]
        for e, s in enumerate(self.slot_of):
            (self.blobs[s] if s < N_SLOTS else self.spare[s - N_SLOTS]).copy_(torch.from_numpy(store[e]))
        self.blobs, self.spare = self.blobs.to(DEVICE), self.spare.to(DEVICE)
        self.slot_map = torch.tensor(self.slot_of, dtype=torch.int32, device=DEVICE)  # [n_expert]

    def reference(self, x: np.ndarray, w: np.ndarray, ids: np.ndarray) -> np.ndarray:
        out = np.zeros(x.shape, np.float64)  # [N, d]
        for t in range(x.shape[0]):
            for j, e in enumerate(ids[t]):
                m = self.ref[e]
                g, u = m["gate"] @ x[t], m["up"] @ x[t]  # [ff]
                out[t] += w[t, j] * (m["down"] @ (g / (1.0 + np.exp(-g)) * u))
        return out


def q1_0_dequant(raw: np.ndarray) -> np.ndarray:
    """Q1_0 from ggml's block layout (gguf-py has no Q1_0 dequantizer). llama.cpp
    ggml/src/ggml-common.h `block_q1_0`: float16 d, then uint8 qs[16] for 128 weights;
    ggml-quants.c `dequantize_row_q1_0`: weight j is +d if bit j % 8 of qs[j / 8] is set, else -d."""
    blocks = raw.reshape(-1, 18)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]
    bits = np.unpackbits(blocks[:, 2:], axis=1, bitorder="little")  # [n_blocks, 128]: bit j%8 of byte j//8
    return np.where(bits == 1, d, -d).reshape(-1)


def reference_dequant(raw: np.ndarray, q: Q, n_out: int, n_in: int) -> np.ndarray:
    """float32 [n_out, n_in] by an independent decoder: gguf-py's numpy code, or `q1_0_dequant`."""
    if q == Q.Q1_0:
        return q1_0_dequant(raw).reshape(n_out, n_in)
    return gguf_dequantize(raw.reshape(n_out, -1), q).reshape(n_out, n_in)


def slot_layout(qtypes: tuple[Q, Q], d: int, ff: int):
    """The device slot layout of one layer with gate/up of type qtypes[0], down of qtypes[1]."""
    index = ExpertIndex(1, N_EXPERT)
    shapes = [("gate", qtypes[0], (d, ff)), ("up", qtypes[0], (d, ff)), ("down", qtypes[1], (ff, d))]
    index.tensors.append([(name, TensorInfo(name, q, (*shape, N_EXPERT), 0, nbytes(q, shape) * N_EXPERT))
                          for name, q, shape in shapes])
    return slot_layouts(index)[0]


def nbytes(q: Q, shape: tuple[int, int]) -> int:
    """Bytes of one expert's matrix of ggml shape (n_in, n_out)."""
    block, size = GGML_QUANT_SIZES[q]
    return shape[0] // block * size * shape[1]


def routing(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """ids [n, k] (distinct per row; ragged: experts get different row counts) and weights [n, k]."""
    rng = np.random.default_rng(seed)
    ids = np.stack([rng.permutation(N_EXPERT)[:k] for _ in range(n)])
    return ids, rng.uniform(0.1, 1.0, (n, k))


def run_mix(bank: Bank, n: int, k: int, seed: int = 0) -> None:
    d = bank.ref[0]["gate"].shape[1]
    x = np.random.default_rng(50 + seed).standard_normal((n, d))
    ids, w = routing(n, k, seed)
    kern = tx.SlotKernels([bank.lay], torch.device(DEVICE))
    assert kern.supports(0)
    got = kern.mix(0, bank.blobs, bank.spare, bank.slot_map, torch.tensor(x, dtype=torch.float32, device=DEVICE),
                   torch.tensor(w, dtype=torch.float32, device=DEVICE), torch.tensor(ids, device=DEVICE))
    want = bank.reference(x.astype(np.float32).astype(np.float64), w.astype(np.float32), ids)
    assert got.dtype == torch.float32 and got.shape == (n, d)
    err, scale = np.abs(got.cpu().double().numpy() - want).max(), np.abs(want).max()
    assert err <= RTOL * scale, f"max abs error {err:.3g} > {RTOL} * max |ref| {scale:.3g}"


def shape_for(q: Q) -> tuple[int, int]:
    """(d, ff) of a small expert: rows of whole blocks (32: 64 x 96; 64, 128: 128 x 128; 256 x 256)."""
    block = GGML_QUANT_SIZES[q][0]
    return (64, 96) if block <= 32 else (max(block, 128),) * 2


@pytest.mark.parametrize("qtype", tq.KERNEL_TYPES, ids=lambda q: q.name)
def test_dequantize_is_bit_exact(qtype: Q) -> None:
    block = GGML_QUANT_SIZES[qtype][0]
    n_in = 96 if block <= 32 else 2 * block
    raw = tq.random_blocks(int(qtype), 19, n_in, np.random.default_rng(int(qtype)))  # 19 rows: a ragged tile
    got = tq.dequantize(torch.from_numpy(raw).to(DEVICE), int(qtype), 19, n_in).cpu().numpy()
    want = reference_dequant(raw, qtype, 19, n_in)
    assert np.abs(want).max() > 0 and np.array_equal(got, want)


def test_nvfp4_every_scale_byte_and_the_q1_0_reference() -> None:
    """NVFP4: all 256 UE4M3 scale bytes (0 and 0x7F decode to 0, bit 7 is ignored) against gguf-py.
    Q1_0: the reference itself on a hand-made block (d = 0.5, only bits 0 and 9 set)."""
    raw = tq.random_blocks(int(Q.NVFP4), 64, 64, np.random.default_rng(7)).reshape(64, 36)  # 64 blocks
    raw[:, :4] = np.arange(256, dtype=np.uint8).reshape(64, 4)
    got = tq.dequantize(torch.from_numpy(raw.reshape(-1)).to(DEVICE), int(Q.NVFP4), 64, 64).cpu().numpy()
    assert np.array_equal(got, gguf_dequantize(raw, Q.NVFP4))
    block = np.zeros(18, np.uint8)
    block[:2] = np.frombuffer(np.float16(0.5).tobytes(), np.uint8)
    block[2], block[3] = 0b1, 0b10
    want = np.full(128, -0.5, np.float32)
    want[[0, 9]] = 0.5
    assert np.array_equal(q1_0_dequant(block), want)


@pytest.mark.parametrize("qtype", QUANTS, ids=lambda q: q.name)
def test_decode_mix_matches_reference(qtype: Q) -> None:
    d, ff = shape_for(qtype)
    bank = Bank((qtype, qtype), d, ff, seed=int(qtype))
    run_mix(bank, n=1, k=2)  # one token
    run_mix(bank, n=3, k=3, seed=1)  # ragged: experts shared by 1-3 rows, some in spare rows


@pytest.mark.parametrize("qtypes", [(Q.Q4_K, Q.Q6_K), (Q.IQ1_S, Q.Q2_K), (Q.Q1_0, Q.NVFP4)],
                         ids=["Q4_K-Q6_K", "IQ1_S-Q2_K", "Q1_0-NVFP4"])
def test_prefill_mix_and_mixed_types_and_fused_gate_up(qtypes: tuple[Q, Q]) -> None:
    """The usual Q4_K_M mix (Q6_K down), a dynamic 1-bit quant's (IQ1_S gate/up, Q2_K down), and
    two types of other block sizes (128, 64) in one layer; decode and prefill paths."""
    bank = Bank(qtypes, 256, 256, fused=True)
    run_mix(bank, n=2, k=2)
    run_mix(bank, n=tx.DECODE_MAX_ROWS + 3, k=2, seed=2)  # prefill: dequantize + matmul


def test_bfloat16_order_independence_and_types_without_a_kernel() -> None:
    bank = Bank((Q.Q8_0, Q.Q8_0), 64, 96)
    kern = tx.SlotKernels([bank.lay], torch.device(DEVICE))
    x = torch.randn(2, 64, device=DEVICE)
    ids = torch.tensor([[0, 4, 2], [3, 1, 5]], device=DEVICE)  # three terms: float sums depend on the order
    w = torch.rand(2, 3, device=DEVICE)
    f32 = kern.mix(0, bank.blobs, bank.spare, bank.slot_map, x, w, ids)
    bf = kern.mix(0, bank.blobs, bank.spare, bank.slot_map, x.bfloat16(), w.bfloat16(), ids)
    assert bf.dtype == torch.bfloat16
    assert (bf.float() - f32).abs().max() <= 0.02 * f32.abs().max()
    swapped = kern.mix(0, bank.blobs, bank.spare, bank.slot_map, x, w.flip(1), ids.flip(1))
    assert torch.equal(swapped, f32)  # summed in ascending expert order, whatever order the router gave
    other = slot_layout((NO_KERNEL, Q.Q8_0), 64, 96)  # no kernel: the caller falls back
    assert not tx.SlotKernels([other], torch.device(DEVICE)).supports(0)


COMPILE = """
import sys
from gguf import GGMLQuantizationType as Q
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moestream.decoder.kernels.gpu import experts as tx, quant as tq

target = GPUTarget("cuda", 90, 32)

def build(kernel, sig, consts):
    triton.compile(ASTSource(kernel, {**sig, **dict.fromkeys(consts, "constexpr")}, constexprs=consts), target=target)

def lut_sig(q):  # the table's pointer type: float32 values or an int8 grid
    return "*i8" if tq.lut(int(q), "cpu").dtype.itemsize == 1 else "*fp32"

def dequant(q):
    build(tq._dequant_kernel, {"src": "*u8", "out": "*bf16", "lut": lut_sig(q), "n_out": "i32", "n_in": "i32",
                               "row_bytes": "i32"}, {"QT": int(q), "BN": 16, "BK": 256})

try:
    dequant(Q.Q8_0)
except (ImportError, RuntimeError, TypeError) as e:  # no NVIDIA backend, or another compile API
    print("no CUDA compiler in this Triton:", e)
    sys.exit(3)
ptrs = {"blobs": "*u8", "spare": "*u8", "ids": "*i64", "slot_map": "*i32", "offs": "*i64", "h": "*fp32"}
scalars = {"n_slots": "i32", "slot_bytes": "i32", "d": "i32", "ff": "i32"}
for q in tq.KERNEL_TYPES:  # every type's decoding, through the dequantize kernel
    dequant(q)
# the expert kernels around it: a LUT type, a K-quant, a grid type with a K-quant down (as dynamic quants mix)
# (per-expert part offsets, the arena read in place, and gpt-oss's biases + clamped SwiGLU with the first pair)
for (qa, qd), per in zip(((Q.MXFP4, Q.MXFP4), (Q.Q4_K, Q.Q4_K), (Q.IQ1_S, Q.Q2_K)), (True, False, False)):
    build(tx._gate_up_kernel, {**ptrs, "x": "*bf16", "lut_g": lut_sig(qa), "lut_u": lut_sig(qa),
                               **scalars, "gate_off": "i32", "up_off": "i32", "g_row_bytes": "i32",
                               "u_row_bytes": "i32", "gb_off": "i32", "ub_off": "i32", "alpha": "fp32",
                               "limit": "fp32"}, {"K": 8, "QG": int(qa), "QU": int(qa), "BN": 16, "BK": 256,
                                                  "PER_EXPERT": per, "HAS_BIAS": per, "ACT": int(per)})
    build(tx._down_kernel, {**ptrs, "weights": "*bf16", "y": "*fp32", "lut_d": lut_sig(qd), **scalars,
                            "down_off": "i32", "row_bytes": "i32", "db_off": "i32"},
          {"QD": int(qd), "BN": 16, "BK": 256, "PER_EXPERT": per, "HAS_BIAS": per})
build(tx._sum_kernel, {"y": "*fp32", "ids": "*i64", "out": "*bf16", "d": "i32"}, {"K": 6, "KP": 8, "BLOCK": 1024})
print("compiled")
"""


def test_every_kernel_compiles_for_sm90() -> None:
    """Compile (no GPU needed) each kernel for each type for an H100/H200 target, in a process
    without the interpreter: Triton's compiler rejects some Python the interpreter runs."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    r = subprocess.run([sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=240,
                       check=False)
    if r.returncode == 3:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0 and "compiled" in r.stdout, r.stderr[-3000:]


# -- the expert sources on the kernels: a tiny model through a real daemon ---------------------
PROMPT = [5, 17, 99, 3, 250, 41, 7]


def logits(model, source, one_sequence: bool) -> torch.Tensor:
    """Logits [T, V] of PROMPT, as one forward pass (prefill path) or token by token (decode path)."""
    cache = model.new_cache(1, len(PROMPT))
    if one_sequence:
        return forward_step(model.with_bank(ExpertBank(source)), torch.tensor([PROMPT], device=model.device), cache)[0].float().cpu()
    return torch.cat([forward_step(model.with_bank(ExpertBank(source)), torch.tensor([[t]], device=model.device), cache)[0]
                      for t in PROMPT]).float().cpu()


@torch.inference_mode()
def test_resident_and_streamed_on_the_kernels(tiny_model, start_daemon) -> None:
    """Resident raw slots on the kernels agree with dequantized experts (float32, 1e-5 of the
    logits' scale); streamed through a daemon with a cache of a quarter of the experts, some
    served from spare rows, equals resident on the kernels bit for bit."""
    from moestream.common.layout import ModelLayout
    from moestream.decoder.experts.source import ResidentExperts
    from moestream.decoder.models import load_model
    from moestream.decoder.experts.gpu.streamed import open_streamed

    layout = ModelLayout(tiny_model)
    model = load_model(layout, DEVICE, torch.float32)
    fused = ResidentExperts(layout, DEVICE, torch.float32, kernels=True)
    assert fused.stats().as_dict()["kernels"] == "triton"
    plain = ResidentExperts(layout, DEVICE, torch.float32, kernels=False)  # dequantized with torch on use
    daemon = start_daemon(tiny_model, arena_slots=8)
    for one_sequence in (False, True):
        want = logits(model, plain, one_sequence)
        got = logits(model, fused, one_sequence)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()
        with open_streamed(layout, daemon.endpoint, device=DEVICE, dtype=torch.float32, slots=2,
                           kernels=True) as src:
            assert torch.equal(logits(model, src, one_sequence), got)
            st = src.stats().as_dict()
            assert st["misses"] > 0 and st["cache"]["kernels"] == "triton"
            if one_sequence:  # 7 tokens x top-2 of 8 experts on 2 slots: some served without a slot
                assert st["bypassed"] > 0


def test_slot_kernels_choice_and_the_one_time_notice(capsys) -> None:
    """Auto: kernels on CUDA only; asked for: layers of types without a kernel keep the torch
    path, said once per process."""
    from moestream.decoder.experts.gpu import slot_format

    mixed = [slot_layout((Q.Q8_0, Q.Q8_0), 64, 96), slot_layout((NO_KERNEL, Q.Q8_0), 64, 96)]
    assert slot_format.slot_kernels(mixed, "cpu", None) is None
    assert slot_format.slot_kernels(mixed, DEVICE, False) is None
    slot_format._NOTICED.clear()
    for _ in range(2):
        kern = slot_format.slot_kernels(mixed, DEVICE, True)
        assert kern.supports(0) and not kern.supports(1)
    err = capsys.readouterr().err
    assert err.count(f"no fused kernel for 1 of 2 expert layers ({NO_KERNEL.name})") == 1, err
