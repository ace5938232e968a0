"""`moestream serve`: an OpenAI-compatible HTTP server with continuous batching.

```
  HTTP clients --> uvicorn event loop (app.py: parse, validate, SSE out, disconnects)
                       | submit(Sequence)            ^ events (token / done / error)
                       v                             | loop.call_soon_threadsafe
                  engine thread (engine.py): schedule -> model.forward_many -> sample
                       |  one expert fetch per layer for the whole step (union of top-k)
                       v
                  expert source: resident (file map) or moestream-iod's arena (streamed)
```

Modules: `config` (ServeConfig and the command line), `engine` (the step loop, admission,
shutdown), `sequence` (one request's state and events), `prefix` (the prefix cache: finished
requests' KV caches reused by a prompt that starts the same), `telemetry` (per-step and
per-request expert traffic), `fields` (which request fields are honoured, the checks),
`openai_api` (requests into jobs, response shapes), `tools` (tool-call formats per family:
parse, stream, force), `text` (detokenizing with stop strings, shared with `moestream chat`),
`metrics` (Prometheus), `middleware` (access log, CORS, API key), `app` (routes), `main`.
Grammar-constrained decoding (json_schema, forced tool calls) is `generation/grammar.py`
(llguidance); its mask is applied per sequence, so constrained and free requests share steps.

HTTP stack: Starlette + uvicorn. Starlette is the small, well-kept ASGI toolkit FastAPI is built
on (streaming responses, disconnect detection, exception handlers) without FastAPI's pydantic
request models, which we do not need: requests are validated by hand into OpenAI's error shape.
uvicorn is the reference ASGI server and runs on uvloop, already a dependency. aiohttp would
have done too; the ASGI pair was chosen because vLLM and SGLang serve the same API on it, so
its behaviour under OpenAI clients (SSE, cancellation) is well trodden.

Continuous batching (nano-vllm style): one `Sequence` per request with its own KV cache
(`model.new_cache(1, prompt + max_tokens)`); sequences join and leave between steps; a
newcomer's prefill (in chunks of the step's token budget) runs in the same step as the others'
decode. The FFN runs once on every sequence's rows, so a layer fetches the union of their
experts once: with streamed experts a step of B sequences costs the distinct experts of B
tokens instead of B x top-k. Where it stops scaling: the union grows with B until a step
touches most of a layer's experts (uniform top-k of E routing: 1 - 1/e, about two thirds, by B = E / k,
8 sequences for 32 experts top-4; measured on the shipped model, expert bytes per token fell
423 -> 261 -> 192 KiB at 1 / 4 / 8 sequences, 44 % of the bank per step at 8); past that every
step reads the whole expert bank and a bigger batch only adds compute. Attention runs per
sequence (lengths differ), so on a CPU large batches are bound by attention and the expert
matmuls, not by fetching.
"""
