"""decoder.qkernels against an independent reference: gguf-py's numpy dequantizer + float64 SwiGLU.

Tolerance: max |kernel - reference| <= RTOL * max |reference| over the expert's output (the
kernels sum in float32, reassociated; the reference in float64 on the same decoded weights).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from moestream.authoring.quantize import ENCODABLE, encode
from moestream.decoder.kernels.cpu import ffn as qk

RTOL = 1e-5
D, FF = 256, 512  # hidden, expert ff: multiples of every block size
NATIVE = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.F32, Q.F16, Q.BF16, Q.Q4_1, Q.Q5_0, Q.Q2_K, Q.IQ4_XS)
FALLBACK = ()  # every supported type has a row decoder now (more in test_qkernels_types.py)
GGUF_QUANTIZES = frozenset((Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1))
# types neither gguf-py nor our encoder writes: random codes, these f16 fields set to this scale
RANDOM_SCALES = {Q.Q5_K: {0: 2e-4, 2: 1e-3}, Q.Q2_K: {80: 2e-3, 82: 1e-3}, Q.IQ4_XS: {0: 2e-5}}
PATHS = {"fused": 1 << 30, "dense": 0}  # DENSE_MIN_ROWS forcing each path


def quantized(qtype: Q, n_out: int, n_in: int, seed: int) -> np.ndarray:
    """[n_out * row_bytes] uint8: a random ~N(0, 0.05) matrix quantized, or random valid blocks."""
    rng = np.random.default_rng(seed)
    if qtype in GGUF_QUANTIZES or qtype in ENCODABLE:
        w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
        raw = gguf_quantize(w, qtype) if qtype in GGUF_QUANTIZES else encode(w, qtype)
        return np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    block, type_size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n_out * n_in // block, type_size), dtype=np.uint8)
    for off, scale in RANDOM_SCALES[qtype].items():
        d = (scale * rng.uniform(0.5, 1.0, len(blocks))).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(-1)


def reference_weights(m: qk.QMatrix) -> np.ndarray:
    """[n_out, n_in] float64, decoded by gguf-py (independent of the kernels)."""
    return gguf_dequantize(m.data.reshape(m.n_out, -1), Q(m.qtype)).astype(np.float64)


def reference(x: np.ndarray, gate: qk.QMatrix, up: qk.QMatrix, down: qk.QMatrix) -> np.ndarray:
    x = x.astype(np.float64)  # [n, d]
    g, u = x @ reference_weights(gate).T, x @ reference_weights(up).T  # [n, ff]
    return (g / (1.0 + np.exp(-g)) * u) @ reference_weights(down).T  # [n, d]


def expert(qtype: Q, seed: int = 0, d: int = D, ff: int = FF) -> tuple:
    return (qk.QMatrix(quantized(qtype, ff, d, seed), int(qtype), ff, d),
            qk.QMatrix(quantized(qtype, ff, d, seed + 1), int(qtype), ff, d),
            qk.QMatrix(quantized(qtype, d, ff, seed + 2), int(qtype), d, ff))


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.dtype == np.float32 and got.shape == want.shape
    err, scale = np.abs(got - want).max(), np.abs(want).max()
    assert err <= RTOL * scale, f"max abs error {err:.3g} > {RTOL} * max |ref| {scale:.3g}"


def rows(n: int, d: int = D, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(100 + seed).standard_normal((n, d)).astype(np.float32)


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(qk, "DENSE_MIN_ROWS", PATHS[request.param])
    return request.param


@pytest.mark.parametrize("qtype", NATIVE + FALLBACK, ids=lambda q: q.name)
def test_matches_reference(qtype: Q, path: str) -> None:
    assert qk.has_kernel(int(qtype)) == (qtype in NATIVE)
    mats = expert(qtype)
    for n in (1, 3, 17, 100):
        x = rows(n, seed=n)
        assert_close(qk.swiglu_expert(x, *mats), reference(x, *mats))


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_0, Q.Q6_K, Q.F32, Q.BF16), ids=lambda q: q.name)
def test_dequantize_bit_exact(qtype: Q) -> None:
    """These types decode with gguf's own float32 operations (one rounding), so bit for bit."""
    m = expert(qtype)[0]
    want = gguf_dequantize(m.data.reshape(m.n_out, -1), qtype)
    np.testing.assert_array_equal(qk.dequantize(m).view(np.uint32), want.view(np.uint32))


def test_f16_every_bit_pattern_and_subnormal_scales() -> None:
    bits = np.arange(1 << 16, dtype=np.uint16)  # every float16: zeros, subnormals, inf, NaN
    m = qk.QMatrix(bits.view(np.uint8), int(Q.F16), 256, 256)
    got, want = qk.dequantize(m).reshape(-1), bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    # Q8_0 blocks whose scale d is subnormal, zero or negative
    raw = quantized(Q.Q8_0, 8, 256, seed=5).reshape(-1, 34)
    scales = np.array([1, 0x3FF, 0x8001, 0, 0x8000, 0x0400, 0x2E66, 0xAE66] * 8, np.uint16)
    raw[:, :2] = scales.view(np.uint8).reshape(-1, 2)
    q8 = qk.QMatrix(raw.reshape(-1), int(Q.Q8_0), 8, 256)
    want = gguf_dequantize(raw.reshape(8, -1), Q.Q8_0)
    np.testing.assert_array_equal(qk.dequantize(q8).view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("qtype", (Q.Q4_K, Q.Q5_0), ids=lambda q: q.name)
def test_read_only_inputs(qtype: Q, path: str, tmp_path) -> None:
    """Bytes from np.frombuffer and from a read-only np.memmap, x read-only: never written."""
    gate, up, down = expert(qtype)
    blob = gate.data.tobytes() + up.data.tobytes() + down.data.tobytes()
    (tmp_path / "experts.bin").write_bytes(blob)
    x = np.frombuffer(rows(3).tobytes(), dtype=np.float32).reshape(3, D)  # read-only
    want = qk.swiglu_expert(x.copy(), gate, up, down)
    for buf in (np.frombuffer(blob, dtype=np.uint8), np.memmap(tmp_path / "experts.bin", mode="r")):
        assert not buf.flags.writeable
        a, b = gate.nbytes, gate.nbytes + up.nbytes
        ro = (qk.QMatrix(buf[:a], gate.qtype, FF, D), qk.QMatrix(buf[a:b], up.qtype, FF, D),
              qk.QMatrix(buf[b:], down.qtype, D, FF))
        np.testing.assert_array_equal(qk.swiglu_expert(x, *ro), want)
    assert (tmp_path / "experts.bin").read_bytes() == blob


@pytest.mark.parametrize("n", (1, 4, 40))
def test_deterministic(n: int) -> None:
    mats, x = expert(Q.Q4_K), rows(n)
    first = qk.swiglu_expert(x, *mats)
    np.testing.assert_array_equal(qk.swiglu_expert(x, *mats).view(np.uint32), first.view(np.uint32))


@pytest.mark.parametrize("qtype", (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.Q2_K), ids=lambda q: q.name)
def test_fused_path_is_independent_of_threads_and_batch(qtype: Q) -> None:
    """Each output row is one thread's fixed-order sum: same bits for any thread count, and a
    row's result does not depend on the other rows of the batch (the single-pass dots of
    rows_dot, Q8_0 .. Q6_K, and the decode-then-dot path of the other types, Q2_K)."""
    mats, x = expert(qtype), rows(6)  # rows 0-3 are dotted four at a time, 4-5 one by one
    threads = qk.numba.get_num_threads()
    try:
        many = qk.swiglu_expert(x, *mats)
        qk.set_threads(1)
        one = qk.swiglu_expert(x, *mats)
    finally:
        qk.set_threads(threads)
    np.testing.assert_array_equal(one.view(np.uint32), many.view(np.uint32))
    for i in (2, 5):
        np.testing.assert_array_equal(qk.swiglu_expert(x[i:i + 1], *mats).view(np.uint32), many[i:i + 1].view(np.uint32))
    np.testing.assert_array_equal(qk.swiglu_expert(x[::-1], *mats).view(np.uint32), many[::-1].view(np.uint32))


def test_concurrent_callers(path: str) -> None:
    """Two Python threads at once (the GIL is released in the kernels; scratch is per thread)."""
    from concurrent.futures import ThreadPoolExecutor

    experts = [expert(Q.Q4_K, seed=10 * i) for i in range(2)]
    x = rows(3)
    want = [qk.swiglu_expert(x, *e) for e in experts]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda i: [qk.swiglu_expert(x, *experts[i % 2]) for _ in range(10)], range(4)))
    for i, results in enumerate(got):
        for y in results:
            np.testing.assert_array_equal(y, want[i % 2])


@pytest.mark.parametrize("qtype", (Q.Q6_K, Q.Q5_0), ids=lambda q: q.name)
def test_accumulate_into_out(qtype: Q, path: str) -> None:
    mats, x = expert(qtype), rows(5)
    base = rows(5, seed=7)
    scale = np.array([0.5, -1.0, 0.0, 2.0, 0.25], np.float32)
    out = base.copy()
    assert qk.swiglu_expert(x, *mats, out=out, scale=scale) is out
    want = base.astype(np.float64) + scale[:, None] * reference(x, *mats)
    assert_close(out, want)
    out = base.copy()
    qk.swiglu_expert(x, *mats, out=out)  # no scale: out += y
    assert_close(out, base + reference(x, *mats))


def test_fused_gate_up_halves_of_one_buffer(path: str) -> None:
    """A `gate_up` part: the gate rows, then the up rows, in one byte view."""
    gate, up, down = expert(Q.Q8_0)
    both = np.frombuffer(gate.data.tobytes() + up.data.tobytes(), dtype=np.uint8)
    half = both.size // 2
    split = (qk.QMatrix(both[:half], int(Q.Q8_0), FF, D), qk.QMatrix(both[half:], int(Q.Q8_0), FF, D), down)
    x = rows(3)
    np.testing.assert_array_equal(qk.swiglu_expert(x, *split), qk.swiglu_expert(x, gate, up, down))


def test_bad_matrices_raise() -> None:
    data = np.zeros(34 * 8 * 2, np.uint8)  # 2 rows of 256 as Q8_0
    qk.QMatrix(data, int(Q.Q8_0), 2, 256)
    with pytest.raises(ValueError, match=r"Q8_0 \[2 x 256\]: expected 2 rows x 8 blocks x 34 B = 544 bytes, got 543"):
        qk.QMatrix(data[:-1], int(Q.Q8_0), 2, 256)
    with pytest.raises(ValueError, match="multiple of the block size 256"):
        qk.QMatrix(np.zeros(144, np.uint8), int(Q.Q4_K), 1, 100)
    with pytest.raises(ValueError, match="uint8"):
        qk.QMatrix(data.view(np.int8), int(Q.Q8_0), 2, 256)
    with pytest.raises(ValueError, match="unknown quant type"):
        qk.QMatrix(data, 9999, 2, 256)
    gate, up, down = expert(Q.Q8_0)
    with pytest.raises(ValueError, match="do not chain"):
        qk.swiglu_expert(rows(1), gate, up, gate)
    with pytest.raises(ValueError, match=r"x must be \[n, 256\]"):
        qk.swiglu_expert(rows(1, d=128), gate, up, down)
    with pytest.raises(ValueError, match="scale must be"):
        qk.swiglu_expert(rows(2), gate, up, down, out=np.zeros((2, D), np.float32), scale=np.ones(3, np.float32))


def test_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    from moestream.decoder.bench.kernels import main

    assert main(["--types", "Q8_0", "Q5_1", "--hidden", "256", "--expert-ff", "256", "--rows", "1", "24",
                 "--repeat", "1", "--pool-mib", "0.5", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert all(0.5 <= r["pool_mib"] < 0.5 + 4 * 0.21 for r in report["results"])  # 4 experts of ~0.2 MiB, copied
    assert {(r["type"], r["rows"]) for r in report["results"]} == {("Q8_0", 1), ("Q8_0", 24), ("Q5_1", 1), ("Q5_1", 24)}
    assert all(r["kernel_ms"] > 0 and r["reference_ms"] > 0 for r in report["results"])
    assert all(r["vs_q8_0"] > 0 and r["ns_per_weight"] > 0 for r in report["results"])
    assert [r["vs_q8_0"] for r in report["results"] if r["type"] == "Q8_0"] == [1.0, 1.0]
    for r in report["results"]:  # the streaming-read bound of the same bytes, and the 1-call rate over it
        assert r["bound_gb_per_s"] > 0 and r["of_bound"] == pytest.approx(r["experts_gb_per_s"] / r["bound_gb_per_s"])


def test_bench_refuses_bad_pool(capsys: pytest.CaptureFixture[str]) -> None:
    from moestream.decoder.bench.kernels import main

    assert main(["--types", "Q8_0", "--pool-mib", "-1"]) == 2
    assert "--pool-mib must be" in capsys.readouterr().err


def test_bench_default_types_are_every_native_type() -> None:
    from moestream.decoder.bench.kernels import default_types

    types = default_types()
    assert types[0] == "Q8_0" and sorted(types) == sorted(q.name for q in qk.NATIVE)


# -- several experts per call -------------------------------------------------------------------
MIXED = ((Q.Q8_0,) * 3, (Q.Q4_K,) * 3, (Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q4_0, Q.Q5_K, Q.F16), (Q.Q5_0,) * 3, (Q.Q8_0,) * 3)


def packed(kinds=MIXED, d: int = D, ff: int = FF) -> tuple[np.ndarray, list[tuple]]:
    """Experts of the given (gate, up, down) types, all views into one read-only byte array."""
    raw = [quantized(q, *shape, seed=10 * e + k)
           for e, types in enumerate(kinds) for k, (q, shape) in enumerate(zip(types, ((ff, d), (ff, d), (d, ff))))]
    base = np.frombuffer(b"".join(r.tobytes() for r in raw), dtype=np.uint8)  # read-only
    experts, off = [], 0
    for e, types in enumerate(kinds):
        mats = []
        for k, (q, (n_out, n_in)) in enumerate(zip(types, ((ff, d), (ff, d), (d, ff)))):
            size = raw[3 * e + k].size
            mats.append(qk.QMatrix(base[off:off + size], int(q), n_out, n_in))
            off += size
        experts.append(tuple(mats))
    return base, experts


def test_experts_match_one_by_one_bit_for_bit() -> None:
    """Each expert's result is the single-expert call's, bit for bit, whatever shares the call:
    mixed types, a fallback type, row counts 0 .. past DENSE_MIN_ROWS, rows out of order."""
    base, experts = packed()
    x = rows(qk.DENSE_MIN_ROWS + 10)  # [N, D]
    idx = [np.array([3]), np.arange(4), np.array([7, 2, 9, 11, 0]), np.arange(2, 11), np.array([5, 1]),
           np.arange(qk.DENSE_MIN_ROWS + 2)]
    table = qk.expert_table(base, experts)
    got = qk.swiglu_experts(x, table, idx)
    for e, (r, mats) in enumerate(zip(idx, experts)):
        want = qk.swiglu_expert(x[r], *mats)
        np.testing.assert_array_equal(got[e].view(np.uint32), want.view(np.uint32), err_msg=f"expert {e}")
        assert_close(got[e], reference(x[r], *mats))
    # other batches of the same experts: same bits
    for subset in ([2], [0, 3], [5, 1, 2]):
        sub = qk.swiglu_experts(x, qk.expert_table(base, [experts[e] for e in subset]), [idx[e] for e in subset])
        for e, y in zip(subset, sub):
            np.testing.assert_array_equal(y.view(np.uint32), got[e].view(np.uint32))
    threads = qk.get_threads()
    try:  # one thread takes every span
        qk.set_threads(1)
        one = qk.swiglu_experts(x, table, idx)
    finally:
        qk.set_threads(threads)
    for y, want in zip(one, got):
        np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))
    empty = qk.swiglu_experts(x, table, [np.zeros(0, np.int64)] * len(experts))
    assert all(y.shape == (0, D) for y in empty)


def test_experts_from_a_read_only_memmap(tmp_path) -> None:
    base, experts = packed(MIXED[:3])
    (tmp_path / "experts.bin").write_bytes(base.tobytes())
    mm = np.memmap(tmp_path / "experts.bin", mode="r")
    views = [tuple(qk.QMatrix(mm[m.addr - base.ctypes.data:][:m.nbytes], m.qtype, m.n_out, m.n_in) for m in e)
             for e in experts]
    x = np.frombuffer(rows(4).tobytes(), dtype=np.float32).reshape(4, D)  # read-only
    idx = [np.array([1]), np.arange(4), np.array([3, 0])]
    got = qk.swiglu_experts(x, qk.expert_table(mm, views), idx)
    for y, r, mats in zip(got, idx, experts):
        np.testing.assert_array_equal(y, qk.swiglu_expert(x[r], *mats))
    assert (tmp_path / "experts.bin").read_bytes() == base.tobytes()


def test_expert_table_checks() -> None:
    base, experts = packed(MIXED[:2])
    other = expert(Q.Q8_0)  # bytes elsewhere
    assert qk.view_offset(base, experts[1][0]) == sum(m.nbytes for m in experts[0])
    assert qk.view_offset(base, experts[1][0].data) == qk.view_offset(base, experts[1][0])
    with pytest.raises(ValueError, match="not inside the base"):
        qk.view_offset(base, other[0])
    with pytest.raises(ValueError, match="expert 1's bytes"):
        qk.expert_table(base, [experts[0], other])
    _, small = packed(MIXED[:1], d=128, ff=256)
    with pytest.raises(ValueError, match="share d and ff"):
        qk.expert_table(base, [experts[0], small[0]])
    table = qk.expert_table(base, experts)
    with pytest.raises(ValueError, match="row indices"):
        qk.swiglu_experts(rows(2), table, [np.array([0]), np.array([2])])
    with pytest.raises(ValueError, match="2 experts but 1 row lists"):
        qk.swiglu_experts(rows(2), table, [np.array([0])])


def test_table_rows_set_one_at_a_time() -> None:
    """A table filled row by row (the arena's, as experts land in slots) gives the same bits as one
    built at once, picks rows in any order, and checks each row when it is set."""
    base, experts = packed()
    x = rows(6)  # [N, D]
    idx = [np.array([0, 5]), np.arange(3), np.array([4])]
    pick = np.array([4, 1, 2])
    t = qk.TableRows(base, len(experts))
    with pytest.raises(ValueError, match="no row was set"):
        t.take(pick)
    for i in reversed(range(len(experts))):
        t.set(i, 100 + i, experts[i])
    assert t.held.tolist() == [100 + i for i in range(len(experts))]
    got = qk.swiglu_experts(x, t.take(pick), idx)
    want = qk.swiglu_experts(x, qk.expert_table(base, [experts[i] for i in pick]), idx)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32))
    t.set(4, 7, experts[0])  # row 4 now holds expert 0's bytes
    np.testing.assert_array_equal(qk.swiglu_experts(x, t.take(np.array([4])), idx[:1])[0],
                                  qk.swiglu_expert(x[idx[0]], *experts[0]))
    with pytest.raises(ValueError, match="not all inside the base"):
        t.set(0, 1, expert(Q.Q8_0))
    small_base, small = packed(MIXED[:1], d=128, ff=256)
    both = np.frombuffer(base.tobytes() + small_base.tobytes(), dtype=np.uint8)
    moved = tuple(qk.QMatrix(both[base.size + m.addr - small_base.ctypes.data:][:m.nbytes], m.qtype, m.n_out, m.n_in)
                  for m in small[0])
    mixed = qk.TableRows(both, 2)
    mixed.set(0, 0, tuple(qk.QMatrix(both[m.addr - base.ctypes.data:][:m.nbytes], m.qtype, m.n_out, m.n_in)
                          for m in experts[0]))
    with pytest.raises(ValueError, match="share d, ff and biases"):
        mixed.set(1, 0, moved)


@pytest.mark.parametrize("act", ["swiglu", "swiglu_oai_clamped"])
def test_expert_activation_matches_float64(act: str) -> None:
    """The kernels' activation (their own vectorized exp) against float64 numpy, one row at a time
    (the many-row path) and as a one-row expert's span: within 4 float32 ulp of the exact value,
    0 where that underflows, and the same bits both ways."""
    from moestream.decoder.kernels.cpu import rows as kr
    from moestream.common.arch import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT

    g = np.concatenate([np.linspace(-100, 100, 40001), [0.0, -0.0, 1e-30, -1e-30, 88.5, -88.5, 1e30, -1e30]])
    g = g.astype(np.float32)  # [n]
    u = np.random.default_rng(0).uniform(-3, 3, g.size).astype(np.float32)  # [n]
    code = qk.act_code(act)
    one = np.array([kr._act(a, b, code) for a, b in zip(g[:2000].tolist(), u[:2000].tolist())], np.float32)
    rg, ru = np.zeros(g.size + 16, np.float32), np.zeros(g.size + 16, np.float32)
    rg[:g.size], ru[:g.size] = g, u
    h = np.zeros((1, g.size), np.float32)
    kr._act_span(rg, ru, g.size, h, 0, 0, code)
    np.testing.assert_array_equal(one.view(np.uint32), h[0, :2000].view(np.uint32))
    g64, u64 = g.astype(np.float64), u.astype(np.float64)
    if act == "swiglu":
        want = g64 / (1.0 + np.exp(np.minimum(-g64, 700))) * u64
    else:
        gc, uc = np.minimum(g64, SWIGLU_OAI_LIMIT), np.clip(u64, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT)
        arg = (np.float32(-SWIGLU_OAI_ALPHA) * gc.astype(np.float32)).astype(np.float64)  # (a float32 product)
        want = gc / (1.0 + np.exp(np.minimum(arg, 700))) * (uc + 1.0)
    tiny = np.abs(want) < 1e-30
    assert (np.abs(h[0][tiny]) < 1e-30).all()
    err = np.abs(h[0][~tiny] - want[~tiny]) / np.abs(want[~tiny])
    assert err.max() < 4 * 2.0 ** -24, f"worst relative error {err.max():.3g} at g = {g[~tiny][err.argmax()]}"
