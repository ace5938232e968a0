"""`ServeConfig`: everything `moestream serve` (and `moestream chat`) is told, validated on construction."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from ...common.split import SPLIT_NAME
from ..cli import add_threads_arg
from ..config import ConfigError, DecoderConfig

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class ServeConfig:
    model: str = ""  # GGUF file
    iod: str | None = None  # moestream-iod endpoint (streamed experts)
    resident: bool = False  # every expert in process, no daemon
    host: str = "127.0.0.1"  # loopback by default, like the daemon
    port: int = 8000  # 0 = any free port (printed on start)
    served_model_name: str | None = None  # the `model` id clients send; default: the file's stem
    max_seqs: int = 8  # sequences decoded together; more wait in line
    max_step_tokens: int = 256  # tokens per step: every decode token + prefill chunks of newcomers
    max_model_len: int | None = None  # prompt + completion limit; default: the model's context length
    device: str = "auto"
    dtype: str = "auto"
    kv_dtype: str = "auto"  # the KV cache's (auto: dtype; float16 halves it)
    prefetch: int = 1  # router look-ahead layers for streamed experts (0 = off)
    fetch_timeout_s: float = 60.0
    metrics_port: int | None = None  # also serve /metrics alone on this loopback port
    progress: bool = False
    threads: int | None = None  # compute threads of the engine (None: every core)
    chat_template: str | None = None  # a jinja file that replaces the GGUF's tokenizer.chat_template
    api_key: str | None = None  # clients must send Authorization: Bearer KEY
    cors_origin: list[str] | None = None  # origins browsers may call from ("*": any)
    access_log: bool = True  # one line per request on stderr
    shutdown_grace_s: float = 5.0  # SIGTERM: running replies get this long, then end with an error event
    prefix_cache_mb: int = 256  # KV caches of finished requests kept for prompts that start the same (0 = off)

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("no model given (--model PATH)")
        if not Path(self.model).is_file():
            raise ConfigError(f"--model {self.model}: no such file")
        if bool(self.iod) == bool(self.resident):
            raise ConfigError("choose exactly one expert source: --iod ENDPOINT (streamed) or --resident")
        for name, low in (("port", 0), ("max_seqs", 1), ("max_step_tokens", 1), ("max_model_len", 2),
                          ("metrics_port", 0), ("prefetch", 0), ("threads", 1), ("prefix_cache_mb", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
                raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
        for name in ("port", "metrics_port"):
            if (getattr(self, name) or 0) > 65535:
                raise ConfigError(f"--{name.replace('_', '-')} must be <= 65535, got {getattr(self, name)}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ConfigError(f"--chat-template {self.chat_template}: no such file")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"--shutdown-grace must be >= 0, got {self.shutdown_grace_s}")
        if self.max_step_tokens < self.max_seqs:  # so a step always has room for a newcomer's prefill
            raise ConfigError(f"max_step_tokens ({self.max_step_tokens}) must be >= max_seqs ({self.max_seqs})")
        _ = self.decoder_config()  # device, dtype and source options are checked as `generate` checks them

    @property
    def model_id(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        m = SPLIT_NAME.match(Path(self.model).name)  # a part of a split model: the model's name, not the part's
        return m["stem"] if m else Path(self.model).stem

    def decoder_config(self) -> DecoderConfig:
        """The expert-source options in `generate`'s terms, to open the source the same way
        (its prompt fields are required there and unused here)."""
        return DecoderConfig(model=self.model, prompt_ids=[[0]], iod=self.iod, resident=self.resident,
                             device=self.device, dtype=self.dtype, kv_dtype=self.kv_dtype, prefetch=self.prefetch,
                             fetch_timeout_s=self.fetch_timeout_s, progress=self.progress, threads=self.threads)


def add_source_args(ap: argparse.ArgumentParser) -> None:
    """Model and expert-source options shared by `serve` and `chat`."""
    ap.add_argument("--model", required=True, help="GGUF MoE file")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--iod", metavar="ENDPOINT",
                     help="stream experts from this moestream-iod (e.g. ipc:///run/moestream/iod.sock)")
    src.add_argument("--resident", action="store_true", help="load every expert in process (no daemon)")
    ap.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    ap.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    ap.add_argument("--kv-dtype", dest="kv_dtype", default="auto",
                    help="the KV cache's: auto (= --dtype), float16 (half the memory and reads of long contexts), "
                         "float32, bfloat16 (cuda)")
    ap.add_argument("--prefetch", type=int, default=1, help="router look-ahead layers for streamed experts (0 = off)")
    ap.add_argument("--max-model-len", type=int, dest="max_model_len",
                    help="limit on prompt + completion tokens (default: the model's context length)")
    ap.add_argument("--prefix-cache-mb", dest="prefix_cache_mb", type=int, metavar="MB",
                    help="keep finished requests' KV caches up to MB (default 256; 0 = off): a prompt that starts "
                         "like one of them (the next chat turn) prefills only the rest")
    ap.add_argument("--chat-template", dest="chat_template", metavar="FILE",
                    help="a jinja chat template replacing the GGUF's tokenizer.chat_template")
    add_threads_arg(ap)


def add_batching_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--max-seqs", type=int, default=8, dest="max_seqs",
                    help="sequences decoded together in one step (default 8); more requests wait in line")
    ap.add_argument("--max-step-tokens", type=int, default=256, dest="max_step_tokens",
                    help="tokens per step (default 256): each running sequence's next token plus chunks of "
                         "newcomers' prompts, so a long prompt never stalls the others for long")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moestream serve", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_source_args(ap)
    add_batching_args(ap)
    ap.add_argument("--host", default="127.0.0.1",
                    help="address to listen on (default 127.0.0.1: this machine only; elsewhere set --api-key)")
    ap.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port, printed)")
    ap.add_argument("--served-model-name", dest="served_model_name",
                    help="the model id clients send (default: the GGUF file name without .gguf)")
    ap.add_argument("--metrics-port", type=int, dest="metrics_port",
                    help="also serve the Prometheus metrics alone on this port (same host); /metrics is always on --port")
    ap.add_argument("--api-key", dest="api_key",
                    help="require Authorization: Bearer KEY on /v1/*, /tokenize, /detokenize (or $MOESTREAM_API_KEY)")
    ap.add_argument("--cors-origin", dest="cors_origin", action="append", metavar="ORIGIN",
                    help="let browsers on ORIGIN call the API (repeatable; * = any)")
    ap.add_argument("--no-access-log", dest="access_log", action="store_false", default=None,
                    help="do not log one line per request")
    ap.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float, metavar="S",
                    help="on SIGTERM, running replies get S seconds (default 5), then end with an error event")
    return ap


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    import os

    cfg = {k: v for k, v in vars(args).items() if v is not None}
    if "api_key" not in cfg and os.environ.get("MOESTREAM_API_KEY"):
        cfg["api_key"] = os.environ["MOESTREAM_API_KEY"]
    return ServeConfig(**cfg)


DESCRIPTION = """\
Serve a GGUF Mixture-of-Experts model over HTTP with OpenAI's API, experts resident in this
process (--resident) or streamed from a moestream-iod daemon (--iod ENDPOINT).

Endpoints:
  GET  /v1/models, /v1/models/ID  the served model (id, context length)
  POST /v1/completions            text completion (prompt: text or token ids)
  POST /v1/chat/completions       chat, rendered with the chat template (GGUF's or --chat-template)
  POST /tokenize, /detokenize     {prompt} or {messages} -> {tokens, count}; {tokens} -> {prompt}
  GET  /health                    200 when the engine and its daemon answer, 503 with the reason
  GET  /metrics                   Prometheus text format (requests, tokens, TTFT, expert bytes)

Request fields: max_tokens (max_completion_tokens), temperature, top_p, top_k, min_p, seed,
stop (up to 4 strings), n, stream (+ stream_options.include_usage), logprobs (completions: 0-20
alternatives with text_offset; chat: logprobs + top_logprobs), presence_penalty,
frequency_penalty, repetition_penalty, logit_bias, ignore_eos, response_format (json_object,
json_schema: constrained decoding), tools + tool_choice (auto, none, required, a named function)
+ parallel_tool_calls; best_of only equal to n. Any other field is a 400 naming it (user,
metadata, store, service_tier are accepted no-ops). Errors come in OpenAI's shape
{"error": {"message", "type", "param", "code"}}; a prompt + max_tokens over the context length
is a 400 with code context_length_exceeded. A client that disconnects cancels its request.
`usage.moestream` carries the request's share of the expert traffic (bytes fetched, arena
hits and misses, stall seconds, prefetch's hidden share).

Requests are batched continuously: they join and leave the running batch between steps, and
all sequences of a step share one expert fetch per layer.

Example:
  moestream serve --model model.gguf --iod ipc:///run/moestream/iod.sock
  curl -s localhost:8000/v1/chat/completions -H 'content-type: application/json' \\
    -d '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 32}'
"""
