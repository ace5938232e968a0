"""The daemon's hotness history across restarts, `moestream warm`, and its Prometheus metrics,
all through real daemon processes."""

from __future__ import annotations

import json
import shutil
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from moestream.common.client import IodClient
from moestream.tools.status import get_status
from moestream.common.traces import write_trace
from moestream.tools.warm import main as warm_main


def _fetch_and_release(endpoint: str, keys: list[tuple[int, int]], times: int = 1) -> None:
    with IodClient(endpoint, name="t") as c:
        for _ in range(times):
            c.release_many([f.result(10) for f in c.fetch(keys)])


def test_history_survives_a_restart_and_warm_top_refills_the_arena(tiny_model, start_daemon, tmp_path, capsys):
    history = tmp_path / "state" / "hotness.json"
    args = ["--history-file", str(history)]
    d = start_daemon(tiny_model, arena_slots=8, extra_args=args)
    _fetch_and_release(d.endpoint, [(0, 3), (1, 5)], times=3)
    _fetch_and_release(d.endpoint, [(1, 2)])
    assert d.stop() == 0
    doc = json.loads(history.read_text())  # written at stop
    assert sorted(map(tuple, doc["counts"])) == [(0, 3, 3), (1, 2, 1), (1, 5, 3)]

    d2 = start_daemon(tiny_model, arena_slots=8, extra_args=args)  # a fresh arena: cold
    assert get_status(d2.status_endpoint, hottest=2)["hottest"] == [[0, 3, 3], [1, 5, 3]]
    assert get_status(d2.status_endpoint)["arena"]["resident"] == 0
    assert warm_main(["--iod", d2.endpoint, "--status", d2.status_endpoint, "--top", "2"]) == 0
    assert "warmed 2 of 2 experts" in capsys.readouterr().out
    s = get_status(d2.status_endpoint)
    assert s["arena"]["resident"] == 2 and s["arena"]["leases"] == 0  # cached, nothing held
    before = s["hits"]
    _fetch_and_release(d2.endpoint, [(0, 3), (1, 5)])
    assert get_status(d2.status_endpoint)["hits"] == before + 2  # the first request after the restart hits


def test_history_of_another_model_is_set_aside(tiny_model, make_tiny_model, start_daemon, tmp_path):
    history = tmp_path / "hotness.json"
    other = make_tiny_model(arch="qwen3moe", quant="Q8_0", seed=7)  # same shapes, other weights
    d = start_daemon(other, extra_args=["--history-file", str(history)])
    _fetch_and_release(d.endpoint, [(0, 1)])
    d.stop()
    d2 = start_daemon(tiny_model, extra_args=["--history-file", str(history)])
    assert get_status(d2.status_endpoint)["hottest"] == []
    assert "is for another model" in d2.log_text()
    history.write_text("{not json")
    d3 = start_daemon(tiny_model, extra_args=["--history-file", str(history)])  # never refuses to start
    assert "unreadable" in d3.log_text() and d3.alive()


def test_warm_from_a_trace_makes_the_first_request_hit(tiny_model, start_daemon, tmp_path, capsys):
    trace = tmp_path / "trace.json"
    steps = [[(0, 1), (0, 4), (1, 2), (1, 6)], [(0, 1), (0, 5), (1, 2), (1, 7)]]
    write_trace(trace, steps, 2, 8)
    keys = sorted({k for s in steps for k in s})
    rates = {}
    for mode in ("cold", "warm"):
        d = start_daemon(tiny_model, arena_slots=8)
        if mode == "warm":
            assert warm_main(["--iod", d.endpoint, "--trace", str(trace)]) == 0
            assert "warmed 6 of 6 experts" in capsys.readouterr().out
        before = get_status(d.status_endpoint)
        _fetch_and_release(d.endpoint, keys)
        after = get_status(d.status_endpoint)
        rates[mode] = (after["hits"] - before["hits"]) / (after["requests"] - before["requests"])
        d.stop()
    print(f"first request's hit rate: cold {rates['cold']:.2f}, after warm --trace {rates['warm']:.2f}")
    assert rates["cold"] == 0.0 and rates["warm"] == 1.0


def test_warm_explains_bad_input(tmp_path, capsys):
    assert warm_main(["--iod", "ipc:///nonexistent/iod.sock", "--trace", str(tmp_path / "no.json")]) == 1
    assert "moestream warm:" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        warm_main(["--top", "5", "--trace", "x.json"])  # one or the other


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_parse_and_agree_with_status(tiny_model, start_daemon):
    port = _free_port()
    d = start_daemon(tiny_model, arena_slots=8, extra_args=["--metrics-port", str(port)])
    _fetch_and_release(d.endpoint, [(0, 0), (0, 1), (1, 1)], times=2)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    s = get_status(d.status_endpoint)

    def value(family: str, sample: str, **labels) -> float:
        return next(x.value for x in families[family].samples if x.name == sample and x.labels == labels)

    assert value("moestream_iod_requests", "moestream_iod_requests_total", result="hit") == s["hits"] == 3
    assert value("moestream_iod_requests", "moestream_iod_requests_total", result="miss") == s["misses"] == 3
    assert value("moestream_iod_served_bytes", "moestream_iod_served_bytes_total") == s["bytes_served"]
    assert value("moestream_iod_arena_slots", "moestream_iod_arena_slots") == 8
    latency = "moestream_iod_fetch_latency_seconds"
    assert value(latency, f"{latency}_count", result="miss") == 3 and value(latency, f"{latency}_count", result="hit") == 3
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/other", timeout=5)
    assert e.value.code == 404


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss(8) to list listening sockets")
def test_metrics_listen_on_loopback_only(tiny_model, start_daemon):
    import subprocess

    port = _free_port()
    start_daemon(tiny_model, extra_args=["--metrics-port", str(port)])
    listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True).stdout
    local = [line.split()[3] for line in listening.splitlines()]  # State Recv-Q Send-Q Local Peer
    assert local == [f"127.0.0.1:{port}"], listening


def test_a_taken_metrics_port_is_one_clear_error(tiny_model, tmp_path):
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        p = subprocess.run([sys.executable, "-m", "moestream.iod.main", "--model", str(tiny_model),
                            "--endpoint", f"ipc://{tmp_path}/i.sock", "--status-endpoint", f"ipc://{tmp_path}/s.sock",
                            "--metrics-port", str(port)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 1 and f"metrics port {port}" in p.stderr and "Traceback" not in p.stderr
    assert not list(tmp_path.iterdir())  # sockets removed (and the arena: the session leak check)
