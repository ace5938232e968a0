"""`moestream serve` as llama-server / vLLM users drive it, through the official `openai` client
against real server processes: structured output (checked with `jsonschema`), tool calls in the
Qwen (hermes) and gpt-oss (harmony) formats, streamed tool calls, the sampling fields, n,
logprobs' text_offset, tokenize, the API key, CORS, SIGTERM mid-stream and a daemon that goes away.
Greedy tokens are checked against the resident decoder in this process.
"""

from __future__ import annotations
from moestream.decoder.experts.bank import ExpertBank
from moestream.decoder.generation.loop import forward_step

import http.client as hc
import json
import signal
import time
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import openai
import pytest
import torch

import moestream

MODEL = Path(moestream.__file__).parent / "data" / "tiny-qwen3moe-q8_0.gguf"
TEMPLATES = Path(__file__).parent / "templates"
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
# short: a tool list costs a lot of tokens in the tiny model's 4096-token vocabulary and 256-token context
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]
ASK = [{"role": "user", "content": "weather in Paris?"}]


# -- fixtures ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def resident():
    from moestream.common.layout import ModelLayout
    from moestream.decoder.experts.resident import QuantResidentExperts
    from moestream.decoder.generation.tokenizer import GGUFTokenizer
    from moestream.decoder.models import load_model

    layout = ModelLayout(MODEL)
    model = load_model(layout, "cpu", torch.float32, keep_quantized=True)
    with QuantResidentExperts(layout) as experts:
        yield model, experts, GGUFTokenizer.from_layout(layout)


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A resident server speaking a Qwen-style template (tools section, <tool_call> turns)."""
    from moestream.decoder.serve.process import spawn_server

    log = tmp_path_factory.mktemp("qwen") / "serve.log"
    with spawn_server(MODEL, ["--resident"], log, ["--chat-template", str(TEMPLATES / "qwen_tools.jinja")]) as srv:
        yield srv


@pytest.fixture(scope="module")
def harmony(tmp_path_factory):
    """A gpt-oss-style (harmony) template, an API key and one CORS origin; SIGTERM'd by the last test."""
    from moestream.decoder.serve.process import spawn_server

    log = tmp_path_factory.mktemp("harmony") / "serve.log"
    extra = ["--chat-template", str(TEMPLATES / "harmony_tools.jinja"), "--api-key", "sesame",
             "--cors-origin", "http://app.example", "--shutdown-grace", "0"]
    with spawn_server(MODEL, ["--resident"], log, extra) as srv:
        yield srv


def client_of(srv, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


def http(srv, method: str, path: str, body: object = None, headers: dict | None = None):
    u = urlparse(srv.url)
    conn = hc.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.request(method, path, None if body is None else json.dumps(body),
                 {"content-type": "application/json", **(headers or {})})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, dict(resp.getheaders()), json.loads(data) if data else None


def greedy(resident, ids: list[int], n: int, adjust=None) -> list[int]:
    """The resident decoder's greedy tokens, `adjust(logits, out)` applied to each step's logits [V]."""
    model, experts, tok = resident
    cache, out = model.new_cache(1, len(ids) + n), []
    with torch.inference_mode():
        logits = forward_step(model.with_bank(ExpertBank(experts)), torch.tensor([ids]), cache, last_only=True)[0]
        for _ in range(n):
            t = int((adjust(logits.clone(), out) if adjust else logits).argmax())
            if t in tok.stop_ids:
                break
            out.append(t)
            logits = forward_step(model.with_bank(ExpertBank(experts)), torch.tensor([[t]]), cache, last_only=True)[0]
    return out


# -- structured output ------------------------------------------------------------------------------
def test_json_schema_replies_validate(qwen):
    c = client_of(qwen)
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": WEATHER, "strict": True}}
    for seed in (1, 2):
        r = c.chat.completions.create(model="tiny-qwen3moe-q8_0", messages=ASK, max_tokens=40, temperature=1.0,
                                      seed=seed, response_format=rf)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    r = c.completions.create(model="tiny-qwen3moe-q8_0", prompt="data = ", max_tokens=40, temperature=0,
                             extra_body={"response_format": {"type": "json_object"}})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].text), dict)
    else:  # cut by max_tokens: still the start of one object
        assert r.choices[0].text.startswith("{")


def test_grammars_apply_per_sequence_inside_one_batch(qwen, resident):
    """Two schema-constrained requests and a free one run in the same steps: each follows its own
    grammar (or none: the free one is the resident decoder's greedy reply)."""
    import concurrent.futures as cf

    tok = resident[2]
    c = client_of(qwen)
    other = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
             "additionalProperties": False}

    def constrained(schema: dict) -> str:
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return c.chat.completions.create(model="tiny-qwen3moe-q8_0", messages=ASK, max_tokens=40, temperature=0,
                                         response_format=rf).choices[0].message.content

    def free() -> str:
        return c.completions.create(model="tiny-qwen3moe-q8_0", prompt="def main(", max_tokens=30,
                                    temperature=0).choices[0].text

    with cf.ThreadPoolExecutor(3) as pool:
        a, b, f = pool.submit(constrained, WEATHER), pool.submit(constrained, other), pool.submit(free)
        jsonschema.validate(json.loads(a.result()), WEATHER)
        jsonschema.validate(json.loads(b.result()), other)
        assert f.result() == tok.decode(greedy(resident, tok.encode("def main("), 30))


# -- tool calls --------------------------------------------------------------------------------------
def test_tool_choice_none_leaves_the_tools_out(qwen):
    c = client_of(qwen)
    r = c.chat.completions.create(model="tiny-qwen3moe-q8_0", messages=ASK, max_tokens=2, temperature=0,
                                  tools=TOOLS, tool_choice="none")
    plain = c.chat.completions.create(model="tiny-qwen3moe-q8_0", messages=ASK, max_tokens=2, temperature=0)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens and not r.choices[0].message.tool_calls


def test_a_harmony_answer_is_its_final_channel():
    from moestream.decoder.serve.http.tools import ToolStream, parse

    text = "<|channel|>analysis<|message|>think<|end|><|start|>assistant<|channel|>final<|message|>Hi there"
    assert parse("harmony", text) == ("Hi there", [])
    s = ToolStream("harmony")
    shown = "".join(s.add(text[i:i + 4])[0] for i in range(0, len(text), 4)) + s.finish()[0]
    assert shown == "Hi there"


@pytest.mark.parametrize("fmt, text, name, args", [
    ("hermes", 'Sure.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     "get_weather", {"city": "Oslo"}),
    ("glm", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>",
     "get_weather", {"city": "Oslo"}),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                 '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>', "get_weather", {"city": "Oslo"}),
    ("deepseek", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Oslo"}'
                 "<｜tool▁call▁end｜><｜tool▁calls▁end｜>", "get_weather", {"city": "Oslo"}),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', "get_weather",
     {"city": "Oslo"}),
    ("harmony", "<|channel|>analysis<|message|>need weather<|end|><|start|>assistant<|channel|>commentary "
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}', "get_weather",
     {"city": "Oslo"}),
])
def test_each_familys_call_text_parses(fmt, text, name, args):
    """The call text each family's template teaches (as its own template and docs write it)."""
    from moestream.decoder.serve.http.tools import ToolStream, parse

    _, calls = parse(fmt, text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(name, args)]
    s = ToolStream(fmt)  # streamed a few characters at a time, the same call comes out once
    got = []
    for i in range(0, len(text), 3):
        got += s.add(text[i:i + 3])[1]
    got += s.finish()[1]
    assert [(c.name, json.loads(c.arguments)) for c in got] == [(name, args)]

def test_qwen_forced_tool_call_is_parsed_into_tool_calls(qwen):
    r = client_of(qwen).chat.completions.create(model="tiny-qwen3moe-q8_0", messages=ASK, max_tokens=40,
                                                temperature=0, tools=TOOLS, tool_choice="required",
                                                parallel_tool_calls=False)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    schema = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), schema)


def test_streamed_named_tool_call_assembles_from_deltas(qwen):
    stream = client_of(qwen).chat.completions.create(
        model="tiny-qwen3moe-q8_0", messages=ASK, max_tokens=40, temperature=0, tools=TOOLS, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for d in chunk.choices[0].delta.tool_calls or []:
            c = calls.setdefault(d.index, {"name": "", "arguments": "", "id": None})
            c["id"] = c["id"] or d.id
            c["name"] += d.function.name or ""
            c["arguments"] += d.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls
    for c in calls.values():
        assert c["name"] == "get_weather" and c["id"]
        jsonschema.validate(json.loads(c["arguments"]), WEATHER)


def test_tool_turns_in_the_history_render_as_the_template_says(qwen, resident):
    """An assistant turn with content null + tool_calls and a tool message: the prompt is the
    template rendered by plain jinja2 as transformers renders it (arguments as an object)."""
    import jinja2

    tok = resident[2]
    args = {"city": "Oslo", "days": 2}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = client_of(qwen).chat.completions.create(model="tiny-qwen3moe-q8_0", messages=history, max_tokens=4,
                                                temperature=0, tools=TOOLS[:1])
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = lambda x, **_: json.dumps(x, ensure_ascii=False)
    want_msgs = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
        {"role": "tool", "content": "sunny"}]
    text = env.from_string((TEMPLATES / "qwen_tools.jinja").read_text()).render(
        messages=want_msgs, tools=TOOLS[:1], add_generation_prompt=True)
    assert '"arguments": {"city": "Oslo", "days": 2}' in text and "<tool_response>\nsunny" in text
    assert r.usage.prompt_tokens == len(tok.encode(text))
    status, _, t = http(qwen, "POST", "/tokenize", {"messages": history, "tools": TOOLS[:1]})
    assert status == 200 and t["tokens"] == tok.encode(text)


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"messages": ASK, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": ASK, "tool_choice": "required"}, "tool_choice"),
    ({"messages": ASK, "function_call": "auto"}, "function_call"),
    ({"messages": ASK, "audio": {}}, "audio"),
])
def test_refused_chat_fields_name_the_field(qwen, body, param):
    status, _, r = http(qwen, "POST", "/v1/chat/completions", body)
    assert status == 400 and r["error"]["param"] == param, r


def test_tools_with_a_template_that_has_no_tool_format_are_refused(harmony, qwen):
    """The shipped model's own template shows no tools: a 400 naming tools, not a silent drop."""
    from moestream.decoder.serve.process import spawn_server

    log = Path(qwen.log_path).parent / "plain.log"
    with spawn_server(MODEL, ["--resident"], log, ["--no-access-log"]) as plain:
        status, _, r = http(plain, "POST", "/v1/chat/completions", {"messages": ASK, "tools": TOOLS})
        assert status == 400 and r["error"]["param"] == "tools" and "--chat-template" in r["error"]["message"]
    assert '"POST /v1/chat/completions"' not in plain.log_text()
    assert '"POST /v1/chat/completions" 200' in qwen.log_text()  # the access log of the other server


# -- sampling fields ---------------------------------------------------------------------------------
def test_logit_bias_and_ignore_eos(qwen, resident):
    tok = resident[2]
    eos = sorted(tok.stop_ids)[0]
    base = {"prompt": "x = ", "max_tokens": 6, "temperature": 0}
    _, _, r = http(qwen, "POST", "/v1/completions", {**base, "logit_bias": {"42": 100}})
    assert r["choices"][0]["text"] == tok.decode([42] * 6)
    _, _, r = http(qwen, "POST", "/v1/completions", {**base, "logit_bias": {str(eos): 100}})
    assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["finish_reason"] == "stop"
    _, _, r = http(qwen, "POST", "/v1/completions", {**base, "logit_bias": {str(eos): 100}, "ignore_eos": True})
    assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"


def test_penalties_match_a_reference(qwen, resident):
    tok = resident[2]
    prompt = "a a a a b b"
    ids = tok.encode(prompt)
    rep, freq, pres = 1.3, 0.7, 0.4

    def adjust(logits, out):  # CTRL's repetition rule, then OpenAI's frequency and presence terms
        for t in set(ids) | set(out):
            logits[t] = logits[t] / rep if logits[t] > 0 else logits[t] * rep
        for t in set(out):
            logits[t] -= freq * out.count(t) + pres
        return logits

    want = greedy(resident, ids, 10, adjust)
    _, _, r = http(qwen, "POST", "/v1/completions", {"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                     "repetition_penalty": rep, "frequency_penalty": freq,
                                                     "presence_penalty": pres})
    assert r["choices"][0]["text"] == tok.decode(want)
    assert want != greedy(resident, ids, 10)  # the penalties changed the reply


def test_n_choices_are_the_single_requests_with_consecutive_seeds(qwen):
    c = client_of(qwen)
    kw = dict(model="tiny-qwen3moe-q8_0", prompt="def ", max_tokens=8, temperature=1.0)
    both = c.completions.create(n=2, seed=7, **kw)
    alone = [c.completions.create(seed=s, **kw).choices[0].text for s in (7, 8)]
    assert [ch.index for ch in both.choices] == [0, 1]
    assert [ch.text for ch in both.choices] == alone
    assert both.usage.prompt_tokens == 2 * c.completions.create(seed=7, **kw).usage.prompt_tokens


def test_text_offset_counts_each_tokens_text(qwen):
    r = client_of(qwen).completions.create(model="tiny-qwen3moe-q8_0", prompt="import ", max_tokens=8,
                                           temperature=0, logprobs=1)
    lp = r.choices[0].logprobs
    assert lp.text_offset[0] == 0 and len(lp.text_offset) == len(lp.tokens)
    assert [b - a for a, b in zip(lp.text_offset, lp.text_offset[1:])] == [len(t) for t in lp.tokens[:-1]]


# -- other endpoints ---------------------------------------------------------------------------------
def test_tokenize_detokenize_and_model_card(qwen, resident):
    tok = resident[2]
    status, _, r = http(qwen, "POST", "/tokenize", {"prompt": "hello world"})
    assert status == 200 and r["tokens"] == tok.encode("hello world") and r["count"] == len(r["tokens"])
    status, _, r = http(qwen, "POST", "/detokenize", {"tokens": r["tokens"]})
    assert status == 200 and r["prompt"] == "hello world"
    status, _, r = http(qwen, "POST", "/detokenize", {"tokens": [10**7]})
    assert status == 400 and r["error"]["param"] == "tokens"
    c = client_of(qwen)
    assert c.models.retrieve("tiny-qwen3moe-q8_0").id == "tiny-qwen3moe-q8_0"
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve("gpt-4")


def test_a_stop_string_counts_as_a_stop_in_metrics(qwen, resident):
    from prometheus_client.parser import text_string_to_metric_families

    tok = resident[2]
    full = tok.decode(greedy(resident, tok.encode("for i in "), 12))
    stop = full[3:6]

    def stops() -> float:
        u = urlparse(qwen.url)
        conn = hc.HTTPConnection(u.hostname, u.port, timeout=30)
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        return {json.dumps(s.labels): s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "moestream_serve_requests_total"}

    before = stops()
    _, _, r = http(qwen, "POST", "/v1/completions", {"prompt": "for i in ", "max_tokens": 12, "temperature": 0,
                                                     "stop": stop})
    assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == full[:full.index(stop)]
    deadline = time.monotonic() + 10
    while (after := stops())['{"outcome": "stop"}'] == before['{"outcome": "stop"}']:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after['{"outcome": "cancelled"}'] == before['{"outcome": "cancelled"}']


# -- the harmony server: gpt-oss's format, API key, CORS, SIGTERM -------------------------------------
def test_harmony_forced_tool_call_is_parsed(harmony):
    r = client_of(harmony, "sesame").chat.completions.create(
        model="tiny-qwen3moe-q8_0", messages=[{"role": "user", "content": "Oslo?"}], max_tokens=60, temperature=0,
        tools=TOOLS[:1],
        tool_choice="required")
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch
    (call,) = ch.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_api_key_and_cors(harmony):
    with pytest.raises(openai.AuthenticationError):
        client_of(harmony, "wrong").models.list()
    assert client_of(harmony, "sesame").models.list().data[0].id == "tiny-qwen3moe-q8_0"
    assert http(harmony, "GET", "/health")[0] == 200  # probes need no key
    pre = {"origin": "http://app.example", "access-control-request-method": "POST",
           "access-control-request-headers": "authorization, content-type"}
    status, headers, _ = http(harmony, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 204 and headers["access-control-allow-origin"] == "http://app.example"
    assert http(harmony, "OPTIONS", "/v1/models", headers={**pre, "origin": "http://evil.example"})[0] == 403
    status, headers, _ = http(harmony, "GET", "/v1/models", headers={"origin": "http://app.example",
                                                                     "authorization": "Bearer sesame"})
    assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"


def test_sigterm_mid_stream_ends_it_with_an_error_event_and_done(harmony):
    u = urlparse(harmony.url)
    conn = hc.HTTPConnection(u.hostname, u.port, timeout=60)
    body = {"prompt": "def f(", "max_tokens": 250, "temperature": 0, "stream": True, "ignore_eos": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"content-type": "application/json", "authorization": "Bearer sesame"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.readline().startswith(b"data: ")
    harmony.proc.send_signal(signal.SIGTERM)
    rest = resp.read().decode()
    conn.close()
    events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    assert harmony.proc.wait(30) == 0
    log = harmony.log_text()
    assert "Traceback" not in log and "CancelledError" not in log, log


# -- a daemon that goes away -------------------------------------------------------------------------
def test_health_is_503_while_the_daemon_is_gone(tmp_path):
    from moestream.decoder.serve.process import spawn_server
    from moestream.tools.spawn import spawn_daemon

    with spawn_daemon(MODEL, run_dir=tmp_path / "iod") as daemon:
        srv = spawn_server(MODEL, ["--iod", daemon.endpoint], tmp_path / "serve.log", ["--no-access-log"])
        with srv:
            assert http(srv, "GET", "/health")[0] == 200
            daemon.stop()
            deadline = time.monotonic() + 20
            while (h := http(srv, "GET", "/health"))[0] == 200 or "unreachable" not in h[2]["error"]["message"]:
                assert time.monotonic() < deadline, f"health never said the daemon is unreachable: {h}"
                time.sleep(0.2)
            assert h[0] == 503 and "moestream-iod" in h[2]["error"]["message"]
            t0 = time.monotonic()  # a request now is told at once, instead of waiting for experts
            status, _, r = http(srv, "POST", "/v1/completions", {"prompt": "x", "max_tokens": 2})
            assert status == 503 and "unreachable" in r["error"]["message"] and time.monotonic() - t0 < 5


# -- prefix reuse -------------------------------------------------------------------------------------
def test_a_second_chat_turn_prefills_only_its_new_tokens(qwen, resident):
    """Turn 2's prompt starts with turn 1's prompt and reply: the prefix cache gives those keys and
    values, and the greedy reply is still the resident decoder's for the whole prompt."""
    tok = resident[2]
    c = client_of(qwen)
    turn1 = [{"role": "user", "content": "count: one two"}]
    r1 = c.chat.completions.create(model="tiny-qwen3moe-q8_0", messages=turn1, max_tokens=8, temperature=0)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
    ids2 = tok.encode(qwen_render(turn2))
    r2 = c.chat.completions.create(model="tiny-qwen3moe-q8_0", messages=turn2, max_tokens=8, temperature=0)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert r2.usage.prompt_tokens == len(ids2)
    assert cached >= r1.usage.prompt_tokens  # at least all of turn 1's prompt was reused
    assert r2.choices[0].message.content == tok.decode(greedy(resident, ids2, 8))


def qwen_render(messages: list[dict]) -> str:
    import jinja2

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string((TEMPLATES / "qwen_tools.jinja").read_text()).render(messages=messages,
                                                                                 add_generation_prompt=True)
