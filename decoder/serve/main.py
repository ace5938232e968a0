"""`moestream serve` entry point: build the engine, then run uvicorn on a socket bound here
(so `--port 0` can print the port it got) until SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import socket
import sys
from pathlib import Path

from ..config import ConfigError
from .config import ServeConfig, build_parser, config_from_args


def open_engine(cfg: ServeConfig, client_name: str = "moestream-serve"):
    """Layout, tokenizer and a started engine for `cfg` (model and source load on the engine thread)."""
    import dataclasses
    import functools

    from ...common.layout import ModelLayout
    from ..generation.grammar import GrammarBook
    from ..generation.tokenizer import GGUFTokenizer
    from .engine import Engine, open_parts

    layout = ModelLayout(cfg.model)
    tok = GGUFTokenizer.from_layout(layout)
    if cfg.chat_template is not None:
        tok = dataclasses.replace(tok, chat_template=Path(cfg.chat_template).read_text())
    limit = cfg.max_model_len or layout.hparams.context_length
    if cfg.max_model_len and cfg.max_model_len > layout.hparams.context_length:
        raise ConfigError(f"--max-model-len {cfg.max_model_len} is over the model's context length "
                          f"{layout.hparams.context_length}")
    n_vocab = layout.hparams.n_vocab
    grammars = functools.lru_cache(maxsize=1)(lambda: GrammarBook(tok, n_vocab))  # one per server, on first use
    engine = Engine(lambda: open_parts(cfg, layout, tok.stop_ids, client_name), max_seqs=cfg.max_seqs,
                    max_step_tokens=cfg.max_step_tokens, grammars=grammars,
                    prefix_cache_bytes=cfg.prefix_cache_mb << 20)
    engine.grammars = grammars
    engine.start()
    return layout, tok, engine, limit


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(128)
    return sock


def serve(cfg: ServeConfig) -> int:
    import uvicorn

    from .http.app import ServerState, build_app
    from .http.openai_api import Served

    class Server(uvicorn.Server):
        """uvicorn's server, with the engine told first on SIGINT/SIGTERM: it admits nothing more
        and ends replies still running after the grace with an error event (their streams then
        close with [DONE]), so uvicorn's own drain finds them done instead of cancelling them."""

        def __init__(self, config, engine, grace_s: float):
            super().__init__(config)
            self.engine, self.grace_s = engine, grace_s

        def handle_exit(self, sig, frame) -> None:
            if not self.engine.draining:
                print(f"moestream serve: stopping (running replies get {self.grace_s:g} s)", file=sys.stderr,
                      flush=True)
                self.engine.shutdown(self.grace_s)
            super().handle_exit(sig, frame)

    sock = listen(cfg.host, cfg.port)  # first: a taken port fails before the model loads
    engine = None
    try:
        _, tok, engine, limit = open_engine(cfg)
        if cfg.metrics_port is not None:
            from prometheus_client import start_http_server

            start_http_server(cfg.metrics_port, addr=cfg.host, registry=engine.metrics.registry)
        served = Served(tok, cfg.model_id, limit, engine.grammars)
        app = build_app(ServerState(engine, served, tuple(cfg.cors_origin or ()), cfg.api_key, cfg.access_log))
        server = Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                       timeout_graceful_shutdown=cfg.shutdown_grace_s + 5), engine,
                        cfg.shutdown_grace_s)
        host, port = sock.getsockname()[:2]
        print(f"moestream serve: {cfg.model_id} ({'resident' if cfg.resident else 'streamed from ' + cfg.iod}) "
              f"on http://{host if ':' not in host else f'[{host}]'}:{port}", file=sys.stderr, flush=True)
        # uvicorn drains on SIGTERM, restores the handler it found and raises the signal again:
        # a no-op handler makes that end `serve` normally (engine closed, exit 0), not kill it
        signal.signal(signal.SIGTERM, lambda *_: None)
        server.run(sockets=[sock])
    finally:
        sock.close()
        if engine is not None:
            engine.close()
    return 1 if engine.failure else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="moestream serve: %(message)s")
    logging.getLogger("moestream.serve.access").setLevel(logging.INFO)
    from ..cli import run_main

    return run_main("moestream serve", lambda: serve(config_from_args(args)), say_interrupted=False)


if __name__ == "__main__":
    sys.exit(main())
