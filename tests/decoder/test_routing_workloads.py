"""Benchmark workloads that do not flatter: the chain model (greedy decoding walks one cycle of
the vocabulary, so routing spreads) and forced routing (a trace replayed instead of the router),
checked on real decodes against the file's own tensors (gguf-py's reader and dequantizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gq
from moestream.common.traces import load_trace
from moestream.decoder import cli
from moestream.decoder.bench.capped.routing_replay import routing_spread
from moestream.decoder.experts.forced import load_forced
from moestream.common.layout import ModelLayout

CHAIN = dict(routing="chain", layers=3, experts=16, top_k=2, vocab=300)


def _generate(capsys, *args: str) -> dict:
    code = cli.main(["--resident", "--json", "--no-progress", "--threads", "1", *args])
    out = capsys.readouterr()
    assert code == 0, out.err
    return json.loads(out.out.strip().splitlines()[-1])


def _successor_from_file(path) -> dict[int, int]:
    """Token t's greedy successor as the file says it: the token whose output row is t's embedding row."""
    t = {x.name: x for x in GGUFReader(path).tensors}
    emb = gq.dequantize(np.asarray(t["token_embd.weight"].data), t["token_embd.weight"].tensor_type)
    out = gq.dequantize(np.asarray(t["output.weight"].data), t["output.weight"].tensor_type)
    emb, out = emb.reshape(-1, emb.shape[-1]), out.reshape(-1, out.shape[-1])  # [V, d]
    succ = {}
    for u in range(len(out)):
        same = np.flatnonzero((emb == out[u]).all(axis=1))
        assert len(same) == 1, f"output row {u} is not exactly one embedding row"
        succ[int(same[0])] = u
    return succ


def test_chain_model_decodes_along_one_cycle_with_spread_routing(make_tiny_model, tmp_path, capsys):
    path = make_tiny_model(**CHAIN)
    succ = _successor_from_file(path)
    seen, t = {0}, succ[0]
    while t not in seen:  # one cycle through the whole vocabulary
        seen.add(t)
        t = succ[t]
    assert len(seen) == CHAIN["vocab"]
    trace = tmp_path / "t.json"
    r = _generate(capsys, "--model", str(path), "--prompt-ids", "3,4,5", "-n", "40", "--trace-out", str(trace))
    toks = [5] + r["tokens"][0]
    assert all(succ[a] == b for a, b in zip(toks, toks[1:]))  # a new token every step
    spread = routing_spread(load_trace(trace), CHAIN["layers"], CHAIN["experts"])
    assert spread["share"] >= 0.9 and not spread["narrow"], spread


def test_forced_routing_is_what_the_decoder_routes_to(make_tiny_model, tmp_path, capsys):
    path = make_tiny_model(**CHAIN)
    rng = np.random.default_rng(1)
    ids = np.stack([rng.permutation(CHAIN["experts"])[:2] for _ in range(7 * 3)]).reshape(7, 3, 2)  # [T, L, k]
    np.save(tmp_path / "f.npy", ids.astype(np.int16))
    trace = tmp_path / "t.json"
    _generate(capsys, "--model", str(path), "--prompt-ids", "3,4,5", "-n", "8", "--trace-out", str(trace),
              "--force-routing", str(tmp_path / "f.npy"))
    steps = load_trace(trace)
    prompt = [(la, int(e)) for p in range(3) for la in range(3) for e in ids[p, la]]  # a key per row that chose it
    assert sorted(steps[0]) == sorted(prompt) and len(set(prompt)) < len(prompt)  # (repeats: the policy's uses)
    for s, step in enumerate(steps[1:], start=1):  # decode step s is position 2 + s, wrapping after 7
        pos = (2 + s) % 7
        assert sorted(step) == sorted((la, int(e)) for la in range(3) for e in sorted(set(ids[pos, la].tolist())))


def test_a_bad_forced_trace_is_one_line(make_tiny_model, tmp_path, capsys):
    path = make_tiny_model(**CHAIN)
    hp = ModelLayout(path).hparams
    np.save(tmp_path / "k.npy", np.zeros((4, 3, 3), np.int16))
    with pytest.raises(ValueError, match=r"top-k 2\], got int16 \[4, 3, 3\]"):
        load_forced(tmp_path / "k.npy", hp)
    np.save(tmp_path / "e.npy", np.full((4, 3, 2), 16, np.int16))
    with pytest.raises(ValueError, match=r"in \[0, 16\)"):
        load_forced(tmp_path / "e.npy", hp)
    (tmp_path / "t.json").write_text("{}")
    assert cli.main(["--model", str(path), "--resident", "--prompt-ids", "1", "--force-routing",
                     str(tmp_path / "t.json")]) == 1
    assert "needs a .npy trace" in capsys.readouterr().err


def test_llamacpp_replays_forced_routing(make_tiny_model, tmp_path):
    """llama.cpp's eval callback overwrites every layer's selected experts: all rows are forced
    (llama.cpp's last layer computes only the output row), and what it decodes follows the trace."""
    pytest.importorskip("llama_cpp")
    from moestream.decoder.bench.capped.llamacpp_peer import llamacpp_child

    path = make_tiny_model(layers=3, experts=16, top_k=2, vocab=300)  # a random router: experts change the text

    def run(seed):
        ids = np.stack([np.random.default_rng([seed, t]).permutation(16)[:2] for t in range(16 * 3)]).reshape(16, 3, 2)
        np.save(tmp_path / f"f{seed}.npy", ids.astype(np.int16))
        spec = {"model": str(path), "prompt": [3, 4, 5], "tokens": 4, "threads": 1, "n_ctx": 32, "temperature": 0.0,
                "seed": 0, "block_stat": None, "extra_bufts": False, "force_routing": str(tmp_path / f"f{seed}.npy")}
        return llamacpp_child(spec)

    a, b, a2 = run(1), run(2), run(1)
    assert a["forced_rows"] == (3 + 3 + 1) + 3 * 3  # prefill: all 3 rows, 3 rows, the last row; 3 decode steps
    assert a["tokens"] == a2["tokens"] and a["tokens"] != b["tokens"], (a["tokens"], b["tokens"])
