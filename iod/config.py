"""moestream-iod's configuration: one validated dataclass from a TOML file plus CLI overrides."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import typing
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moestream.common import units
from moestream.common.protocol import DEFAULT_ENDPOINT, DEFAULT_STATUS_ENDPOINT

from .limits import memory_limit
from .peers import FAIR_BY
from .readers import BACKENDS, MAX_DEPTH

DEFAULT_CONFIG = Path("/etc/moestream/iod.toml")
DEFAULT_ARENA_BYTES = 1 << 30
ARENA_SIZING = ("memory", "arena_bytes", "arena_slots")  # one of them, at most
LOG_LEVELS = ("debug", "info", "warning", "error")


class ConfigError(ValueError):
    pass


def parse_size(text: str | int) -> int:
    try:
        return units.parse_size(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def parse_memory(text: str | int) -> int:
    """A size, or a percentage ('50%') of what this process may use: physical memory, or its
    memory cgroup's limit where that is smaller (limits.py)."""
    try:
        return units.parse_size(text, percent_of=memory_limit().bytes)
    except ValueError as e:
        raise ConfigError(f"memory: {e}") from None


def parse_mode(text: str | int) -> int:
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    try:
        return int(str(text), 8)
    except ValueError:
        raise ConfigError(f"bad file mode {text!r} (octal, e.g. 0660)") from None


@dataclass(frozen=True)
class IodConfig:
    model: Path
    endpoint: str = DEFAULT_ENDPOINT
    status_endpoint: str = DEFAULT_STATUS_ENDPOINT
    arena_bytes: int | None = None  # arena size; or arena_slots, or memory; default 1 GiB capped at the model's experts
    arena_slots: int | None = None
    memory: int | None = None  # the daemon's whole budget in bytes: the arena gets it less the daemon's own use
    backend: str = "auto"
    queue_depth: int = 32
    direct: bool | None = None  # O_DIRECT reads; None: automatic (startup.choose_direct)
    # Publish which expert each arena slot holds (common.arena.Directory), so a decoder computes
    # an expert already in the arena without a round trip; off: every use is a fetch and a lease.
    directory: bool = True
    lease_timeout_s: float = 30.0
    socket_group: str | None = None
    socket_mode: int = 0o660  # ipc socket files and the shm arena
    log_level: str = "info"
    allow_remote: bool = False  # a tcp:// endpoint on a non-loopback address
    allow_abstract: bool = False  # ipc://@name (Linux abstract sockets: no file, so no permissions apply)
    max_queued: int = 65536  # queued expert loads (now + ahead) before `busy`/`dropped`
    max_queued_per_client: int = 16384  # one client's experts requested and not yet answered, before `busy`
    max_requests_total: int = 131072  # all clients' experts requested and not yet answered (~250 B each), before `busy`
    max_replies_queued: int = 20000  # replies (~1 KiB at most) waiting for one client to read them; then dropped
    ahead_max_age_s: float = 5.0  # queued `ahead` work older than this is dropped as stale
    now_reserve: float = 0.25  # share of read places and of arena slots prefetches may not take
    # Fairness between clients (see `lease_quota`): one client's leases plus its requests in
    # progress never pass this share of the arena's slots, so a client that leases all it can and
    # never lets go still leaves the rest to the others; a request waits at most queue_deadline_s
    # for arena room (its client's quota, or a slot while the arena is full of leases) before
    # it is answered `deadline`.
    client_lease_share: float = 0.5
    queue_deadline_s: float = 5.0
    # Whose share that is (iod/peers.py): "uid" (one per user, from the kernel's peer credentials),
    # "pid" (one per process) or "connection"; and how long a recalled lease may stay before the
    # daemon takes it back (iod/fairness.py).
    fair_by: str = "uid"
    recall_grace_s: float = 1.0
    # Request counts per expert kept on disk (iod/history.py), for `moestream warm --top N` after a restart
    history_file: Path | None = None
    history_interval_s: float = 60.0
    metrics_port: int | None = None  # Prometheus text at http://127.0.0.1:PORT/metrics (iod/metrics.py)

    def lease_quota(self, n_slots: int, top_k: int) -> int | None:
        """Leases plus requests in progress one client may have: `client_lease_share` of the
        slots, but never fewer than one token's top-k (a layer's demand must fit) and never more
        than the arena less a top-k (or half of it); None (no quota) for a share of 1. Half by default: two clients fit side
        by side, and the decoder's own prefetch limit (half the arena less a top-k) leaves each
        decoder a top-k of its quota for demand."""
        if self.client_lease_share >= 1:
            return None
        room = n_slots - min(top_k, n_slots // 2)  # never the whole arena: another share's layer must fit
        return max(1, min(room, max(top_k, int(n_slots * self.client_lease_share))))

    def reserved(self, capacity: int) -> int:
        """How many of `capacity` read places or arena slots are kept for `now` work."""
        return int(capacity * self.now_reserve)

    def __post_init__(self) -> None:
        for name in ("endpoint", "status_endpoint"):
            ep = getattr(self, name)
            if not re.match(r"^(ipc|tcp)://.+", ep):
                raise ConfigError(f"{name} {ep!r} must look like ipc:///path or tcp://127.0.0.1:PORT")
            if ep.startswith("ipc://@") and not self.allow_abstract:
                raise ConfigError(f"{name} {ep!r} is an abstract socket: it has no file, so socket_mode and "
                                  "socket_group do not apply and any local user (any uid in this network "
                                  "namespace) could connect; use ipc:///path, or pass --allow-abstract "
                                  "(allow_abstract = true) to accept that")
            if ep.startswith("tcp://") and not self.allow_remote and not _loopback(ep):
                raise ConfigError(f"{name} {ep!r} is not a loopback address: decoders share the arena through "
                                  "this host's /dev/shm anyway; pass --allow-remote to bind it regardless")
        if self.endpoint == self.status_endpoint:
            raise ConfigError("endpoint and status_endpoint must differ")
        given = [k for k in ARENA_SIZING if getattr(self, k) is not None]
        if len(given) > 1:
            raise ConfigError(f"give one of memory, arena_bytes, arena_slots, not {' and '.join(given)}")
        _positive(self, "arena_bytes", "arena_slots", "memory", "queue_depth", "lease_timeout_s", "max_queued",
                  "max_queued_per_client", "max_requests_total", "max_replies_queued", "ahead_max_age_s", "queue_deadline_s",
                  "history_interval_s", "recall_grace_s")
        if self.fair_by not in FAIR_BY:
            raise ConfigError(f"fair_by {self.fair_by!r} not one of {', '.join(FAIR_BY)}")
        if self.metrics_port is not None and not (isinstance(self.metrics_port, int) and 0 < self.metrics_port < 65536):
            raise ConfigError(f"metrics_port must be a TCP port in 1..65535, got {self.metrics_port!r}")
        if isinstance(self.now_reserve, bool) or not 0 <= self.now_reserve < 1:
            raise ConfigError(f"now_reserve must be a share in [0, 1), got {self.now_reserve!r}")
        if isinstance(self.client_lease_share, bool) or not 0 < self.client_lease_share <= 1:
            raise ConfigError(f"client_lease_share must be a share in (0, 1], got {self.client_lease_share!r}")
        if self.queue_depth > MAX_DEPTH:
            raise ConfigError(f"queue_depth {self.queue_depth} is above the maximum of {MAX_DEPTH}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} not one of {', '.join(BACKENDS)}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level {self.log_level!r} not one of {', '.join(LOG_LEVELS)}")
        if not 0 <= self.socket_mode <= 0o777 or self.socket_mode & 0o007:
            raise ConfigError(f"socket_mode {oct(self.socket_mode)} must not grant access to others (e.g. 0660)")

    def ipc_paths(self) -> list[Path]:
        """The socket files of the ipc endpoints (abstract `ipc://@name` ones have none)."""
        return [Path(ep[len("ipc://"):]) for ep in (self.endpoint, self.status_endpoint)
                if ep.startswith("ipc://") and not ep.startswith("ipc://@")]


def _loopback(endpoint: str) -> bool:
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


def _positive(cfg: IodConfig, *names: str) -> None:
    for name in names:
        v = getattr(cfg, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
            raise ConfigError(f"{name} must be a positive number, got {v!r}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="moestream-iod",
        description="The moestream I/O daemon: owns a GGUF MoE file and serves its experts to decoders "
        "through a shared-memory arena (ZeroMQ + msgpack). Options override the TOML config file.",
        epilog="Config-file-only keys: max_queued (queued expert reads before `busy`, default 65536), "
        "max_queued_per_client (one client's requested experts not yet answered before `busy`, default 16384), "
        "max_requests_total (the same for all clients together, default 131072), "
        "max_replies_queued (replies waiting for one client to read them before they are dropped, leaving no "
        "lease, default 20000), "
        "ahead_max_age_s (queued prefetches older than this are dropped, default 5). "
        "now_reserve (share of read places and of arena slots prefetches may not take, default 0.25). "
        "history_interval_s (seconds between saves of the history file, default 60). "
        "SIGHUP is ignored (logged): restart the daemon to apply a changed config. "
        "Exit codes: 0 clean stop (SIGTERM/SIGINT), 1 fatal error, 2 bad configuration.")
    a = p.add_argument
    a("--version", action="version", version=f"moestream-iod {_version()}")
    a("--config", type=Path, metavar="PATH", help=f"TOML file with the same keys as these options (underscores), default {DEFAULT_CONFIG} if it exists")
    a("--model", metavar="PATH", help="the GGUF MoE file to serve (required here or in the config)")
    a("--endpoint", metavar="URL", help=f"ZeroMQ endpoint for requests (default {DEFAULT_ENDPOINT})")
    a("--status-endpoint", metavar="URL", help=f"ZeroMQ endpoint answering `status` (default {DEFAULT_STATUS_ENDPOINT})")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--memory", metavar="SIZE", help="the daemon's whole memory budget, e.g. 12GiB or 50%% (of physical "
                   "memory, or of this process's memory cgroup limit where smaller): the arena gets it less the daemon's own use, in whole slots")
    g.add_argument("--arena-bytes", metavar="SIZE", help="shared-memory arena (host cache tier) size, e.g. 4GiB (default 1GiB, capped at all experts)")
    g.add_argument("--arena-slots", type=int, metavar="N", help="arena size in slots of one expert blob each")
    a("--backend", choices=BACKENDS, help="reader: io_uring, a preadv thread pool, or auto (uring, else threads with a note)")
    a("--queue-depth", type=int, metavar="N", help="reads in flight at the device (default 32)")
    a("--direct", action=argparse.BooleanOptionalAction, default=None,
      help="O_DIRECT reads (bypass the page cache; the arena is the cache). Default: automatic, on when the "
      "page cache could not hold the experts the arena does not (the model's experts exceed the memory "
      "limit less the arena) and the file system takes O_DIRECT")
    a("--directory", action=argparse.BooleanOptionalAction, default=None,
      help="publish a read-only directory of the arena (which expert each slot holds) so decoders compute experts "
      "already there without a round trip (default on; --no-directory: every use is a fetch and a lease)")
    a("--lease-timeout", type=float, dest="lease_timeout_s", metavar="SECONDS", help="seconds without a message before a client's leases are freed (default 30)")
    a("--client-lease-share", type=float, metavar="SHARE",
      help="share of the arena's slots one client may hold leases on (with its requests in progress), e.g. 0.5; "
      "never less than the model's top-k experts, and only while another client is connected (one alone may use "
      "the whole arena). Requests past it wait for the client's own releases. Default "
      "0.5: two clients fit side by side, and a decoder's prefetch limit (half the arena less a top-k) leaves it room "
      "for demand; 1 turns the quota off (one client may lease the whole arena and queue more)")
    a("--fair-by", choices=FAIR_BY, help="what one share of the arena belongs to: a user (uid, the default), a "
      "process (pid), or each connection; known from the kernel on ipc (tcp connections are each their own)")
    a("--recall-grace", type=float, dest="recall_grace_s", metavar="SECONDS",
      help="how long a lease the daemon recalled (its share is over quota while others wait) may stay before "
      "the daemon takes it back (default 1)")
    a("--queue-deadline", type=float, dest="queue_deadline_s", metavar="SECONDS",
      help="longest a request waits for arena room (its client over quota, or every slot leased) before it is "
      "answered with the error `deadline` (default 5)")
    a("--history-file", type=Path, metavar="PATH",
      help="keep per-expert request counts in this file (small JSON, atomic writes every history_interval_s, "
      "default 60, and at stop), so `moestream warm --top N` can refill the arena after a restart "
      "(default: no history; the systemd unit keeps it in /var/lib/moestream)")
    a("--metrics-port", type=int, metavar="PORT",
      help="serve Prometheus metrics at http://127.0.0.1:PORT/metrics (loopback only; default off)")
    a("--socket-group", metavar="GROUP", help="group owning the ipc sockets and the arena (default: the daemon's group)")
    a("--socket-mode", metavar="MODE", help="octal mode of the ipc sockets and the arena (default 0660; never world-accessible)")
    a("--log-level", choices=LOG_LEVELS, help="default info")
    a("--allow-remote", action="store_true", default=None,
      help="allow a tcp:// endpoint on a non-loopback address (default: loopback only)")
    a("--allow-abstract", action="store_true", default=None,
      help="allow ipc://@name abstract-socket endpoints, which have no file and so no permissions: any local "
      "user can connect (default: refused)")
    return p


def _version() -> str:
    try:
        return importlib.metadata.version("moestream")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def load_config(argv: list[str] | None = None) -> IodConfig:
    """Config from TOML (if any) and CLI overrides; raises ConfigError naming what is wrong."""
    args = build_parser().parse_args(argv)
    values = _read_toml(args.config)
    cli = {k: v for k, v in vars(args).items() if v is not None and k != "config"}
    if any(k in cli for k in ARENA_SIZING):  # the CLI's choice of arena sizing replaces the file's, whichever it was
        for k in ARENA_SIZING:
            values.pop(k, None)
    values.update(cli)
    return make_config(values)


def make_config(values: dict[str, Any]) -> IodConfig:
    known = {f.name for f in dataclasses.fields(IodConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown config keys: {', '.join(unknown)}")
    if not values.get("model"):
        raise ConfigError("no model: pass --model PATH or set model in the config file")
    v = dict(values)
    v["model"] = Path(v["model"])
    if isinstance(v.get("history_file"), str):
        v["history_file"] = Path(v["history_file"])
    for key, conv in (("arena_bytes", parse_size), ("memory", parse_memory), ("socket_mode", parse_mode)):
        if key in v and v[key] is not None:
            v[key] = conv(v[key])
    _check_types(v)
    try:
        return IodConfig(**v)
    except TypeError as e:
        raise ConfigError(str(e)) from None


def _check_types(values: dict[str, Any]) -> None:
    """TOML gives strings where a bool was meant (`direct = "false"` is truthy): refuse, naming the key."""
    hints = typing.get_type_hints(IodConfig)
    for key, value in values.items():
        allowed = tuple(t for t in typing.get_args(hints[key]) or (hints[key],) if t is not type(None))
        if float in allowed:
            allowed += (int,)
        ok = value is None and type(None) in typing.get_args(hints[key]) or isinstance(value, allowed)
        if not ok or (isinstance(value, bool) and bool not in allowed):
            names = " or ".join(t.__name__ for t in allowed)
            raise ConfigError(f"{key} must be {names}, got {value!r}")


def _read_toml(path: Path | None) -> dict[str, Any]:
    if path is None:
        if not DEFAULT_CONFIG.is_file():
            return {}
        path = DEFAULT_CONFIG
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config {path}: {e}") from None
    out = {k.replace("-", "_"): v for k, v in data.items()}
    for key in ("lease_timeout", "queue_deadline", "recall_grace"):  # the CLI spellings
        if key in out:
            out[f"{key}_s"] = out.pop(key)
    return out


def resolve_slots(cfg: IodConfig, slot_bytes: int, n_experts_total: int, *, overhead_bytes: int = 0,
                  min_slots: int = 1) -> int:
    """How many arena slots to create: as configured, never more than there are experts.

    With `memory`, the arena gets the budget less `overhead_bytes` (the daemon's own use), in
    whole slots, and at least `min_slots` of them or a ConfigError naming the numbers.
    """
    if cfg.arena_slots is not None:
        n = cfg.arena_slots
    elif cfg.memory is not None:
        n = _slots_in_budget(cfg.memory, slot_bytes, overhead_bytes, min_slots)
    else:
        n = (cfg.arena_bytes or DEFAULT_ARENA_BYTES) // slot_bytes
        if n < 1:
            raise ConfigError(f"arena of {cfg.arena_bytes} bytes cannot hold one {slot_bytes}-byte expert slot")
    return max(1, min(n, n_experts_total))


def _slots_in_budget(memory: int, slot_bytes: int, overhead_bytes: int, min_slots: int) -> int:
    n = max(0, memory - overhead_bytes) // slot_bytes
    if n < min_slots:
        fmt = units.format_size
        need = overhead_bytes + min_slots * slot_bytes
        raise ConfigError(f"memory {fmt(memory)} is too small: the daemon itself uses {fmt(overhead_bytes)}, which "
                          f"leaves room for {n} expert slots of {fmt(slot_bytes)}, and it needs at least {min_slots}; "
                          f"give --memory {fmt(need, up=True)} or more")
    return n
