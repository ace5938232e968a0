"""`moestream serve`: a real server process backed by a real moestream-iod (streamed experts),
spoken to by the official `openai` client and plain HTTP; greedy output is checked against the
resident decoder's `generate()` in this process.
"""

from __future__ import annotations
from moestream.decoder.experts.bank import ExpertBank
from moestream.decoder.generation.loop import forward_step

import concurrent.futures as cf
import http.client
import json
import time
from pathlib import Path
from urllib.parse import urlparse

import openai  # the official client (test extra)
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

import moestream

MODEL = Path(moestream.__file__).parent / "data" / "tiny-qwen3moe-q8_0.gguf"
PROMPTS = ["def main(", "import os\nimport sys\n", "class Parser:\n    def ", "for line in "]


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resident():
    """The reference: the resident decoder in this process, and the model's tokenizer."""
    from moestream.common.layout import ModelLayout
    from moestream.decoder.models import load_model
    from moestream.decoder.experts.resident import QuantResidentExperts
    from moestream.decoder.generation.tokenizer import GGUFTokenizer

    layout = ModelLayout(MODEL)
    model = load_model(layout, "cpu", torch.float32, keep_quantized=True)
    with QuantResidentExperts(layout) as experts:
        yield model, experts, GGUFTokenizer.from_layout(layout)


def reference(resident, ids: list[int], n: int) -> list[int]:
    return references(resident, [ids], n)[0]


def references(resident, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of the resident decoder (a left-padded batch: same tokens as one at a time)."""
    from moestream.decoder.generation.loop import generate

    model, experts, tok = resident
    return generate(model.with_bank(ExpertBank(experts)), prompts, n, stop_ids=tok.stop_ids, pad_id=tok.pad_id).tokens


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`moestream serve --iod` on a free loopback port, with its own daemon; both stopped after."""
    from moestream.tools.spawn import spawn_daemon
    from moestream.decoder.serve.process import spawn_server

    tmp = tmp_path_factory.mktemp("serve")
    with spawn_daemon(MODEL, run_dir=tmp / "iod") as daemon:
        # small limits so the tests also exercise a waiting line (4 requests, 3 places) and prompts
        # prefilled in chunks beside the others' decode (4 tokens a step)
        srv = spawn_server(MODEL, ["--iod", daemon.endpoint], tmp / "serve.log",
                           ["--max-seqs", "3", "--max-step-tokens", "4"])
        srv.daemon = daemon
        try:
            yield srv
        finally:
            rc = srv.stop()
        assert rc == 0, srv.log_text()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(server, path: str, body: object) -> tuple[int, dict]:
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request("POST", path, body if isinstance(body, str) else json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    status, data = resp.status, json.loads(resp.read())
    conn.close()
    return status, data


def scrape(server) -> dict[str, float]:
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return {s.name + json.dumps(s.labels, sort_keys=True) * bool(s.labels): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


# -- the API ------------------------------------------------------------------------------------------
def test_openai_client_streams_a_chat_completion_from_streamed_experts(client, resident):
    tok = resident[2]
    messages = [{"role": "user", "content": "def parse(text):"}]
    want = reference(resident, tok.encode(tok.render_chat(messages)), 16)
    model_id = client.models.list().data[0].id
    stream = client.chat.completions.create(model=model_id, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == tok.decode(want) and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ("length" if len(want) == 16 else "stop")
    assert chunks[-1].usage.completion_tokens == len(want)
    assert chunks[-1].usage.prompt_tokens == len(tok.encode(tok.render_chat(messages)))


def test_text_held_back_sends_no_empty_chunks(client, resident):
    """A stop string the whole reply is a prefix of holds every token's text back until the end:
    the stream then has the role chunk and the final text, not a chunk of nothing per token."""
    tok = resident[2]
    prompt = "def parse(text):"
    want = tok.decode(reference(resident, tok.encode(prompt), 8))
    model_id = client.models.list().data[0].id
    stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0, stream=True,
                                       stop=[want + "\x07"])
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == want and want
    assert all(c.choices[0].text or c.choices[0].finish_reason for c in chunks), [c.choices[0] for c in chunks]


def test_four_concurrent_greedy_requests_equal_four_sequential_ones(client, server, resident):
    tok = resident[2]
    model_id = client.models.list().data[0].id

    def ask(prompt: str) -> str:
        r = client.completions.create(model=model_id, prompt=prompt, max_tokens=16, temperature=0)
        return r.choices[0].text

    sequential = [ask(p) for p in PROMPTS]
    before = scrape(server)
    with cf.ThreadPoolExecutor(4) as pool:
        concurrent = list(pool.map(ask, PROMPTS))
    after = scrape(server)
    assert concurrent == sequential
    assert sequential == [tok.decode(t) for t in references(resident, [tok.encode(p) for p in PROMPTS], 16)]
    steps = after["moestream_serve_step_sequences_count"] - before["moestream_serve_step_sequences_count"]
    seqs = after["moestream_serve_step_sequences_sum"] - before["moestream_serve_step_sequences_sum"]
    assert seqs / steps > 1.5, "the concurrent requests were not batched together"


def test_stop_strings_logprobs_and_usage(server, resident):
    tok = resident[2]
    full = tok.decode(reference(resident, tok.encode(PROMPTS[0]), 20))
    stop = full[6:9]
    assert stop.strip(), full
    status, r = post(server, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 20, "temperature": 0,
                                                 "stop": [stop], "logprobs": 2})
    assert status == 200, r
    c = r["choices"][0]
    assert c["text"] == full[:full.index(stop)] and c["finish_reason"] == "stop"
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == r["usage"]["completion_tokens"]
    for chosen, top in zip(lp["token_logprobs"], lp["top_logprobs"]):  # greedy: the chosen one is the best
        assert len(top) == 2 and chosen <= 0 and abs(chosen - max(top.values())) < 1e-5
    assert r["usage"]["prompt_tokens"] == len(tok.encode(PROMPTS[0]))


def test_metrics_parse_with_the_prometheus_text_parser(server, client):
    client.completions.create(model=client.models.list().data[0].id, prompt="x = ", max_tokens=4, temperature=0)
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/metrics")
    resp = conn.getresponse()
    assert resp.getheader("content-type").startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    conn.close()
    assert families["moestream_serve_time_to_first_token_seconds"].type == "histogram"
    assert families["moestream_serve_requests"].type == "counter"
    m = scrape(server)
    assert m["moestream_serve_generation_tokens_total"] >= 4
    assert m["moestream_serve_time_to_first_token_seconds_count"] >= 1
    assert m["moestream_serve_expert_fetched_bytes_total"] > 0  # streamed: the daemon delivered experts
    assert m["moestream_serve_expert_used_bytes_total"] > 0


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "n": 17}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "functions": []}, "functions"),
    ({"prompt": "x", "guided_json": {}}, "guided_json"),
    ({"prompt": "x", "logit_bias": {"999999": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "x", "ignore_eos": "yes"}, "ignore_eos"),
    ({"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}}, "response_format"),
    ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"prompt": [1, 999999]}, "prompt"),
    ({"prompt": 5}, "prompt"),
])
def test_bad_parameters_get_openai_error_shape(server, body, param):
    status, r = post(server, "/v1/completions", body)
    assert status == 400
    assert r["error"]["type"] == "invalid_request_error" and r["error"]["param"] == param
    assert r["error"]["message"]


def test_other_errors(server, client):
    status, r = post(server, "/v1/chat/completions", {"messages": "hi"})
    assert status == 400 and r["error"]["param"] == "messages"
    status, r = post(server, "/v1/completions", "{not json")
    assert status == 400 and "JSON" in r["error"]["message"]
    status, r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert status == 404 and r["error"]["code"] == "model_not_found"
    status, r = post(server, "/v1/nothing", {})
    assert status == 404 and r["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:  # 256-token context
        client.completions.create(model=client.models.list().data[0].id, prompt="x " * 300, max_tokens=8)
    assert e.value.code == "context_length_exceeded"
    status, r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 256})
    assert status == 400 and r["error"]["code"] == "context_length_exceeded" and "256" in r["error"]["message"]


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_cancels_the_request(server, stream):
    before = scrape(server)
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({"prompt": "def f(", "max_tokens": 240, "temperature": 0,
                                                        "stream": stream}), {"content-type": "application/json"})
    if stream:
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: ")  # the first token is out: generation is under way
    else:
        tokens = "moestream_serve_generation_tokens_total"
        deadline = time.monotonic() + 60
        while scrape(server)[tokens] == before[tokens]:  # wait until it generates
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.02)
    conn.sock.close()  # the client goes away mid-reply
    conn.close()
    key = 'moestream_serve_requests_total{"outcome": "cancelled"}'
    deadline = time.monotonic() + 30
    while (m := scrape(server))[key] == before[key]:
        assert time.monotonic() < deadline, "the request was never cancelled"
        time.sleep(0.1)
    made = m["moestream_serve_generation_tokens_total"] - before["moestream_serve_generation_tokens_total"]
    assert made < 240 and m["moestream_serve_running_sequences"] == 0


def test_usage_carries_the_requests_expert_traffic_the_daemon_counted(server, client):
    """`usage.moestream`: the shares of requests run one after another add up to what the daemon
    served this client over them (both count each expert blob's bytes once per delivery). A blob
    landing between two steps is the next step's; only those landing after the last request's
    last step are in no share: whole blobs, at most one step's prefetches."""
    from moestream.common.layout import ModelLayout
    from moestream.tools.status import get_status

    def served() -> int:
        (me,) = [c for c in get_status(server.daemon.status_endpoint)["clients"] if c["name"] == "moestream-serve"]
        return me["bytes_served"]

    model_id = client.models.list().data[0].id
    before, total = served(), 0
    for prompt in ("while True:", "x = [", "print("):
        r = client.completions.create(model=model_id, prompt=prompt, max_tokens=6, temperature=0)
        total += r.usage.moestream["expert_bytes_fetched"]
        assert r.usage.moestream["steps"] >= 6 and r.usage.moestream["expert_bytes_used"] > 0
    time.sleep(0.3)  # prefetches issued in the last step may land after its reply
    layout = ModelLayout(MODEL)
    blob, step = layout.experts.blob_bytes(0), layout.hparams.n_layer * layout.hparams.n_expert_used
    late = served() - before - total
    assert total > 0 and late >= -3, late  # the shares are rounded to whole bytes
    assert min(late % blob, -late % blob) <= 3 and late <= blob * step, late


def test_health_and_models(server):
    u = urlparse(server.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    conn.close()


# -- pieces ------------------------------------------------------------------------------------------
def _architectures() -> list[str]:
    from moestream.decoder.models import architectures

    return architectures()


@pytest.mark.parametrize("arch", _architectures())
def test_forward_many_matches_forward_per_sequence(make_tiny_model, arch):
    """Sequences that join at different steps, batched through forward_many, give each sequence's
    logits alone through forward, up to float rounding: a one-row matmul (GEMV) and a many-row one
    (GEMM) sum in different orders (observed: <= 3e-6 on logits of magnitude ~10). Every family's
    own prepare/attend/ffn/new_cache run as they are."""
    from moestream.common.layout import ModelLayout
    from moestream.decoder.models import load_model
    from moestream.decoder.experts.resident import QuantResidentExperts

    layout = ModelLayout(make_tiny_model(arch=arch))
    model = load_model(layout, "cpu", torch.float32, keep_quantized=True)
    prompts = [[5, 6, 7, 8, 9], [100, 200], [33] * 12]
    with ExpertBank(QuantResidentExperts(layout)) as bank, torch.inference_mode():
        model = model.with_bank(bank)
        alone = []
        for p in prompts:
            cache = model.new_cache(1, 32)
            rows = [forward_step(model, torch.tensor([p]), cache, last_only=True)[0]]
            for _ in range(3):
                rows.append(forward_step(model, rows[-1].argmax().view(1, 1), cache, last_only=True)[0])
            alone.append(rows)
        caches, got = [model.new_cache(1, 32) for _ in prompts], [[] for _ in prompts]
        for step in range(6):
            live = [i for i in range(3) if i <= step and len(got[i]) < 4]
            steps = [(torch.tensor([prompts[i]]) if step == i else got[i][-1].argmax().view(1, 1), caches[i])
                     for i in live]
            bank.begin_step()  # the engine's part: the step is its own
            for i, row in zip(live, model.forward_many(steps)):
                got[i].append(row)
    for a, b in zip(alone, got):
        assert len(a) == len(b) == 4
        for x, y in zip(a, b):
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-4)
            assert y.argmax() == x.argmax()


def test_reply_text_holds_back_and_cuts_stop_strings():
    from moestream.decoder.serve.text import ReplyText

    r = ReplyText(lambda ids: "".join(map(chr, ids)), ["END"])
    pieces = [r.add(ord(c)) for c in "abcENxEN"]
    assert "".join(pieces) == "abcENx"  # "EN" was held back until "x" showed it was no stop
    assert r.add(ord("D")) == "" and r.stopped and r.text == "abcENx"
    r = ReplyText(lambda ids: "".join(map(chr, ids)), ["zz"])
    assert [r.add(ord(c)) for c in "az"] == ["a", ""] and r.finish() == "z"


def test_a_sentencepiece_chat_reply_starts_without_the_words_space(make_tiny_model):
    """`▁Hello` spells its space: kept after a completion's prompt, not at the start of a chat message."""
    from moestream.common.layout import ModelLayout
    from moestream.decoder.serve.text import ReplyText
    from moestream.decoder.generation.tokenizer import GGUFTokenizer

    tok = GGUFTokenizer.from_layout(ModelLayout(make_tiny_model(arch="llama", quant="F32")))
    ids = [i for i in tok.encode("Hello world, again") if i != tok.bos_id]
    assert tok.space_prefix and tok.decode(ids) == " Hello world, again"
    for lstrip, want in ((False, " Hello world, again"), (True, "Hello world, again")):
        r = ReplyText(tok.decode, lstrip=lstrip)
        assert "".join(r.add(i) for i in ids) + r.finish() == want


def test_min_p_keeps_tokens_near_the_best():
    from moestream.decoder.generation.sampling import filter_min_p

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = filter_min_p(logits, 0.5).isfinite()
    assert kept.tolist() == [[True, True, False, False]]  # 0.3 >= 0.25; 0.15 < 0.25


def test_serve_bad_model_is_one_line(tmp_path, capsys):
    from moestream.decoder.serve.main import main

    assert main(["--model", str(tmp_path / "none.gguf"), "--resident"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "none.gguf" in err


def test_serve_on_a_taken_port_is_one_line(capsys):
    import socket

    from moestream.decoder.serve.main import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--model", str(MODEL), "--resident", "--port", str(port)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"cannot listen on 127.0.0.1:{port}" in err
