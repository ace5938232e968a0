"""Generation: batch == one prompt at a time (greedy), stopping, sampling, streaming text, CLI."""

from __future__ import annotations

import pytest
import torch
from moestream.decoder.experts.bank import ExpertBank
from moestream.common.layout import ModelLayout
from moestream.common.units import parse_size
from moestream.decoder import cli
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import TextStream, generate
from moestream.decoder.models import load_model
from moestream.decoder.generation.sampling import (
    Sampler,
    SamplingParams,
    filter_top_k,
    filter_top_p,
)
from moestream.decoder.generation.tokenizer import GGUFTokenizer

PROMPTS = [[5, 17, 200, 33, 41, 9, 300, 12], [77, 3], [450, 451, 452, 1, 2]]


@pytest.fixture(scope="module")
def setup(tiny_model):
    layout = ModelLayout(tiny_model)
    return load_model(layout), ResidentExperts(layout), GGUFTokenizer.from_layout(layout)


def test_batch_equals_one_prompt_at_a_time(setup):
    model, experts, _ = setup
    batch = generate(model.with_bank(ExpertBank(experts)), PROMPTS, 10, keep_logits=True)
    for i, p in enumerate(PROMPTS):
        alone = generate(model.with_bank(ExpertBank(experts)), [p], 10, keep_logits=True)
        assert batch.tokens[i] == alone.tokens[0], f"prompt {i}"
        for step, logits in enumerate(alone.logits):
            assert (batch.logits[step][i] - logits[0]).abs().max().item() < 1e-4
    assert batch.finish == ["length"] * 3 and all(len(t) == 10 for t in batch.tokens)
    assert batch.steps == 9  # one token from the prefill, nine decode steps


def test_stop_token_ends_that_sequence_only(setup):
    model, experts, _ = setup
    free = generate(model.with_bank(ExpertBank(experts)), PROMPTS, 8)
    stop = free.tokens[0][3]  # the 4th token prompt 0 generates becomes a stop id
    out = generate(model.with_bank(ExpertBank(experts)), PROMPTS, 8, stop_ids=frozenset({stop}))
    first = free.tokens[0].index(stop)
    assert out.tokens[0] == free.tokens[0][:first] and out.finish[0] == "stop"
    for i in (1, 2):  # the others continue exactly as before, up to their own stop
        cut = free.tokens[i].index(stop) if stop in free.tokens[i] else 8
        assert out.tokens[i] == free.tokens[i][:cut]


def test_sampling_is_seeded(setup):
    model, experts, _ = setup
    hot = SamplingParams(temperature=1.5, seed=3)
    a = generate(model.with_bank(ExpertBank(experts)), PROMPTS[:2], 12, sampling=hot)
    b = generate(model.with_bank(ExpertBank(experts)), PROMPTS[:2], 12, sampling=hot)
    c = generate(model.with_bank(ExpertBank(experts)), PROMPTS[:2], 12, sampling=SamplingParams(temperature=1.5, seed=4))
    greedy = generate(model.with_bank(ExpertBank(experts)), PROMPTS[:2], 12)
    assert a.tokens == b.tokens and a.tokens != c.tokens and a.tokens != greedy.tokens
    top1 = generate(model.with_bank(ExpertBank(experts)), PROMPTS[:2], 12, sampling=SamplingParams(temperature=1.5, top_k=1, seed=5))
    assert top1.tokens == greedy.tokens


def test_filters():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    assert torch.isinf(filter_top_k(logits, 2)).tolist() == [[True, False, False, True]]
    probs = torch.softmax(logits, -1)[0]  # ~[0.09, 0.64, 0.24, 0.03]
    kept = ~torch.isinf(filter_top_p(logits, float(probs[1]) + 0.01))
    assert kept.tolist() == [[False, True, True, False]]
    assert (~torch.isinf(filter_top_p(logits, 0.01))).sum() == 1  # the best token always survives
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    assert Sampler(SamplingParams())(logits).tolist() == [1]


def test_text_stream_reassembles_text(setup):
    _, _, tok = setup
    ids = tok.encode("héllo wörld ✓ 12 — ok\n")
    pieces = []
    stream = TextStream(tok.decode, lambda i, t: pieces.append(t))
    for t in ids:
        stream(0, t)
    stream.flush()
    assert "".join(pieces) == tok.decode(ids) == "héllo wörld ✓ 12 — ok\n"
    assert all("\ufffd" not in p for p in pieces)


def test_empty_prompt_is_an_error(setup):
    model, experts, _ = setup
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        generate(model.with_bank(ExpertBank(experts)), [[1], []], 2)


def test_cli_resident(tiny_model, capsys):
    rc = cli.main(["--model", str(tiny_model), "--resident", "--prompt", "def f(x):", "-n", "6", "--stats",
                   "--no-progress"])
    cap = capsys.readouterr()
    assert rc == 0 and "tok/s" in cap.err and "stats: experts: source=resident" in cap.err and "experts held" in cap.err
    assert "(quant, " in cap.err and "tok/s" not in cap.out  # counters on stderr, text alone on stdout
    line = next(x for x in cap.err.splitlines() if x.startswith("stats: memory: this process "))
    anon = parse_size(line.split("this process ")[1].split(" anonymous")[0])
    now = int(next(x for x in open("/proc/self/status") if x.startswith("RssAnon:")).split()[1]) << 10
    assert abs(anon - now) <= 64 << 20, (line, now)  # this (in-process) run's own anonymous memory
    rc = cli.main(["--model", str(tiny_model), "--resident", "--prompt", "a", "--prompt", "b", "-n", "3",
                   "--chat", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and "--- [0]" in out and "--- [1]" in out


@pytest.mark.parametrize("args, message", [
    (["--prompt", "x", "--resident"], "no model given"),
    (["--model", "MODEL", "--prompt", "x"], "choose exactly one expert source"),
    (["--model", "/nonexistent.gguf", "--resident", "--prompt", "x"], "no such file"),
    (["--model", "MODEL", "--resident"], "no prompt given"),
    (["--model", "MODEL", "--resident", "--prompt", "x", "--top-p", "2"], "top_p"),
    (["--model", "MODEL", "--resident", "--prompt", "x", "--device", "cuda:7"], "cuda"),
    (["--model", "MODEL", "--resident", "--prompt", "x", "--kv-dtype", "int8"], "kv_dtype must be auto or one of"),
    (["--model", "MODEL", "--resident", "--prompt", "x", "--device", "cpu", "--kv-dtype", "bfloat16"],
     "a bfloat16 KV cache is for CUDA"),
    (["--model", "MODEL", "--resident", "--prompt", "x", "--prefill-chunk", "0"],
     "prefill_chunk must be an integer >= 1"),
])
def test_cli_errors_are_one_line(tiny_model, capsys, args, message):
    if "cuda" in message and torch.cuda.is_available():
        pytest.skip("CUDA present")
    rc = cli.main([str(tiny_model) if a == "MODEL" else a for a in args])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and message in err and len(err.splitlines()) == 1, err


def test_cli_streamed_matches_resident(tiny_model, capsys):
    from moestream.tools.spawn import spawn_daemon

    args = ["--model", str(tiny_model), "--prompt", "import os", "-n", "8", "--no-progress"]
    assert cli.main([*args, "--resident"]) == 0
    resident = capsys.readouterr().out
    assert cli.main([*args, "--resident", "--slot-format", "raw"]) == 0
    resident_raw = capsys.readouterr().out
    with spawn_daemon(tiny_model, arena_slots=6) as daemon:  # a quarter of the experts
        assert cli.main([*args, "--iod", daemon.endpoint, "--stats"]) == 0
        cap = capsys.readouterr()
        assert cap.out == resident and "fetched now" in cap.err and "MiB delivered" in cap.err
        assert cli.main([*args, "--iod", daemon.endpoint, "--slots", "4", "--slot-format", "raw", "--stats"]) == 0
        cap = capsys.readouterr()
    assert cap.out == resident_raw and "hit rate" in cap.err and "slot cache: " in cap.err


def test_cli_json_and_trace(tiny_model, tmp_path, capsys):
    import json

    from moestream.common.traces import load_trace

    trace = tmp_path / "trace.json"
    assert cli.main(["--model", str(tiny_model), "--resident", "--prompt-ids", "5,17,99", "-n", "4", "--json",
                     "--trace-out", str(trace), "--no-progress"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["prompt_tokens"] == [3] and len(r["tokens"][0]) == r["new_tokens"] == 4 and r["decode_tok_s"] > 0
    assert r["memory"]["anon"] > 64 << 20 and r["memory"]["file"] > 0  # torch alone is more
    steps = load_trace(trace)
    assert len(steps) == 4  # the prompt's forward pass and three decode steps
    assert all(len({layer for layer, _ in step}) == 2 for step in steps)  # every layer routed
    assert len(steps[1]) == 2 * 2  # one token: top-2 in each of 2 layers
    assert cli.main(["--model", str(tiny_model), "--resident", "--prompt-ids", "1,999999", "--no-progress"]) == 1
    assert "token ids [999999] are not in the model's vocabulary" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--model", str(tiny_model), "--resident", "--prompt-ids", "1,x"])
    assert "token ids must be comma-separated integers, got '1,x'" in capsys.readouterr().err


def test_cli_without_streamed_module(tiny_model, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "moestream.decoder.experts.gpu.streamed", None)  # import now fails
    rc = cli.main(["--model", str(tiny_model), "--iod", "ipc:///nonexistent", "--prompt", "x", "--no-progress"])
    assert rc == 1 and "streamed mode not available" in capsys.readouterr().err


def test_config_toml_then_cli(tmp_path, tiny_model):
    from moestream.decoder.config import ConfigError, DecoderConfig

    toml = tmp_path / "decoder.toml"
    toml.write_text(f'model = "{tiny_model}"\nresident = true\nprompts = ["a"]\ntemperature = 0.7\nseed = 9\n')
    cfg = cli.config_from_args(cli.build_parser().parse_args(["--config", str(toml), "--seed", "3"]))
    assert (cfg.resident, cfg.prompts, cfg.temperature, cfg.seed) == (True, ["a"], 0.7, 3)
    assert cfg.torch_device.type in ("cpu", "cuda") and cfg.resolved_slot_format in ("raw", "quant")
    toml.write_text('model = "x"\nslotz = 3\n')
    with pytest.raises(ConfigError, match="unknown keys \\['slotz'\\]"):
        DecoderConfig.build(toml)
    with pytest.raises(ConfigError, match="slots must be an integer >= 1"):
        DecoderConfig(model="m", resident=True, prompts=["a"], slots=0)


def _architectures() -> list[str]:
    from moestream.decoder.models import architectures

    return architectures()


@pytest.mark.parametrize("arch", _architectures())
def test_float16_kv_cache_decodes_close_to_float32(make_tiny_model, arch):
    """--kv-dtype float16, every family's own cache and attention (GQA, the latent of MLA, the
    hybrid's full-attention layers): the caches hold float16 (half the bytes), prefill and decode
    steps read them, and the logits stay within float16's rounding of float32's."""
    from moestream.decoder.generation.loop import forward_step

    layout = ModelLayout(make_tiny_model(arch=arch))
    experts = ResidentExperts(layout)
    logits = {}
    for kv in (torch.float32, torch.float16):
        model = load_model(layout, kv_dtype=kv).with_bank(ExpertBank(experts))
        cache = model.new_cache(1, 16)
        assert cache.k[-1].dtype == kv
        with torch.inference_mode():  # the prompt, then the same 3 tokens one at a time (decode steps)
            steps = [forward_step(model, torch.tensor([PROMPTS[0]]), cache, last_only=True)]
            steps += [forward_step(model, torch.tensor([[t]]), cache, last_only=True) for t in (7, 300, 12)]
        logits[kv] = torch.stack(steps)  # [4, 1, V]
    diff = (logits[torch.float16] - logits[torch.float32]).abs().max().item()
    scale = logits[torch.float32].abs().max().item()
    assert 0 < diff <= 2e-2 * scale, (diff, scale)


@pytest.mark.parametrize("arch", _architectures())
def test_prefill_in_chunks_matches_one_pass(make_tiny_model, arch):
    """--prefill-chunk: a left-padded batch prefilled 3 positions a pass (chunks cut through the
    prompts, the short prompts' first chunks all padding) generates what each prompt does alone
    in one pass, in every family (sliding windows, MLA's latent, the hybrid's recurrent state
    carried across chunks)."""
    layout = ModelLayout(make_tiny_model(arch=arch))
    model, experts = load_model(layout), ResidentExperts(layout)
    chunked = generate(model.with_bank(ExpertBank(experts)), PROMPTS, 4, keep_logits=True, prefill_chunk=3)
    for i, p in enumerate(PROMPTS):
        one = generate(model.with_bank(ExpertBank(experts)), [p], 4, keep_logits=True)
        assert chunked.tokens[i] == one.tokens[0], f"prompt {i}"
        for a, b in zip(chunked.logits, one.logits):
            assert (a[i] - b[0]).abs().max().item() < 1e-4 * max(1.0, b.abs().max().item()), f"prompt {i}"


def test_prefill_chunk_must_be_positive(setup):
    model, experts, _ = setup
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        generate(model.with_bank(ExpertBank(experts)), PROMPTS, 2, prefill_chunk=0)


def _rss_anon() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) << 10
    return 0


@pytest.mark.parametrize("arch", ["qwen3moe", "deepseek2", "qwen3next"])  # GQA, MLA's latent, the hybrid's
def test_a_cache_takes_memory_as_it_fills(make_tiny_model, arch):
    """A cache sized for a long context (a chat request without max_tokens gets the model's) is
    resident only where written: 4,000,000 positions (GBs if committed) cost a few MB for a few
    tokens, and decode the same bits as a cache of 16."""
    from moestream.decoder.generation.loop import forward_step

    layout = ModelLayout(make_tiny_model(arch=arch))
    model = load_model(layout).with_bank(ExpertBank(ResidentExperts(layout)))
    logits = {}
    for capacity in (16, 4_000_000):
        before = _rss_anon()
        cache = model.new_cache(1, capacity)
        full = sum(t.nbytes for t in cache.k) + sum(t.nbytes for t in cache.v if t.data_ptr() not in
                                                     {k.data_ptr() for k in cache.k})
        with torch.inference_mode():
            steps = [forward_step(model, torch.tensor([PROMPTS[0]]), cache, last_only=True)]
            steps += [forward_step(model, torch.tensor([[t]]), cache, last_only=True) for t in (7, 300, 12)]
        logits[capacity] = torch.stack(steps)  # [4, 1, V]
        if capacity > 16:
            assert full > 512 << 20, full  # (the test means something: committed, this would be GBs)
            assert _rss_anon() - before < 64 << 20, (_rss_anon() - before) >> 20
        del cache
    assert torch.equal(logits[16], logits[4_000_000])
