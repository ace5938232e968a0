"""Decoders survive a daemon restart (issue 12, item 8): killed with SIGKILL mid-generation and
started again on the same endpoint, the daemon comes back and the decoder finishes with the
same tokens (and, in process, the same logits bit for bit) as resident decoding; with no
daemon coming back it stops with one clear error once the reconnect wait is over."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moestream.decoder.experts.bank import ExpertBank
from moestream.common.client import IodClient, State
from moestream.common.layout import ModelLayout
from moestream.tools.spawn import spawn_daemon
from moestream.tools.status import get_status
from moestream.decoder import cli
from moestream.decoder.experts.arena import open_arena
from moestream.decoder.experts.source import ResidentExperts
from moestream.decoder.generation.loop import generate
from moestream.decoder.models import get_model_module
from moestream.decoder.experts.prefetch import Prefetcher
from moestream.decoder.experts.resident import QuantResidentExperts
from moestream.decoder.experts.gpu.slot_cache import DeviceSlotCache
from moestream.decoder.experts.gpu.streamed import StreamedExperts
from moestream.decoder.models.weights import load_dense

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 300], [400, 2, 33]]
N_NEW = 6
MODEL = dict(arch="qwen3moe", layers=3, experts=8, top_k=2)


class Restarter:
    """SIGKILLs a daemon and starts a new one on its endpoint `delay_s` later, on a thread."""

    def __init__(self, model: Path, run_dir: Path, delay_s: float = 0.3, arena_slots: int | None = None):
        self.model, self.run_dir, self.delay_s, self.slots = model, run_dir, delay_s, arena_slots
        self.daemons = [spawn_daemon(model, run_dir=run_dir, arena_slots=arena_slots)]
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return self.daemons[0].endpoint

    def kill_and_restart(self) -> None:
        self.daemons[0].proc.kill()
        self.daemons[0].proc.wait()
        self._thread = threading.Thread(target=self._start_later)
        self._thread.start()

    def _start_later(self) -> None:
        time.sleep(self.delay_s)
        self.daemons.append(spawn_daemon(self.model, run_dir=self.run_dir, arena_slots=self.slots))

    def wait_restarted(self) -> None:
        if self._thread is not None:
            self._thread.join(30)

    def stop(self) -> None:
        self.wait_restarted()
        for d in self.daemons:
            d.stop()


class KillAfterLayer(Prefetcher):
    """The real prefetcher (after each layer, fetch the next one's predicted experts ahead); after
    layer 0 of forward pass `at_pass`, once those prefetches have landed, the daemon is killed and
    restarted, and the hook returns only when the client has noticed: layer 1 then finds its
    prefetched leases void and its client reconnecting."""

    def __init__(self, model, source, client: IodClient, landed: Callable[[], list], restarter: Restarter,
                 at_pass: int = 3):
        super().__init__(model, source, depth=1, at="layer")
        self.client, self.landed, self.restarter, self.at_pass = client, landed, restarter, at_pass
        self.passes, self.voidable = 0, -1

    def after_layer(self, layer: int, h: torch.Tensor) -> None:
        super().after_layer(layer, h)
        if layer != 0:
            return
        self.passes += 1
        if self.passes != self.at_pass:
            return
        futures = self.landed()
        deadline = time.monotonic() + 10
        while not all(f.done() for f in futures) and time.monotonic() < deadline:
            time.sleep(0.005)
        self.voidable = sum(1 for f in futures if f.done() and not f.cancelled() and f.exception() is None)
        self.restarter.kill_and_restart()
        while self.client.state is State.CONNECTED and time.monotonic() < deadline:
            time.sleep(0.005)
        assert self.client.state is State.RECONNECTING


@pytest.fixture(scope="module")
def setup(make_tiny_model):
    path = make_tiny_model(quant="Q8_0", **MODEL)
    layout = ModelLayout(path)
    model = get_model_module(layout.hparams.arch).Model(layout.hparams, load_dense(layout, "cpu", progress=False))
    return path, layout, model


def same_run(a, b) -> bool:
    return a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_arena_decoder_survives_a_killed_daemon(setup, tmp_path):
    path, layout, model = setup
    with QuantResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, N_NEW, keep_logits=True)
    r = Restarter(path, tmp_path / "run", arena_slots=8)  # 8 of 24 experts: misses and prefetches go on
    try:
        with open_arena(layout, r.endpoint, reconnect_s=20) as src:
            hook = KillAfterLayer(model, src, src.client, lambda: list(src.prefetches._futures.get(1, {}).values()), r)
            got = generate(model.with_bank(ExpertBank(src)), PROMPTS, N_NEW, keep_logits=True, observer=hook)
            stats, reconnects = src.stats().counts, src.client.reconnects
        assert reconnects == 1 and len(r.daemons) == 2
        assert hook.voidable > 0 and stats.voided >= hook.voidable  # landed prefetches fetched again
        assert same_run(got, want)
        assert get_status(r.daemons[1].status_endpoint)["requests"] > 0  # finished against the new daemon
    finally:
        r.stop()


@pytest.mark.parametrize("landing", ["lazy", "eager"])  # eager: the receiver thread lands prefetches
def test_slot_cache_decoder_survives_a_killed_daemon(setup, tmp_path, landing):
    path, layout, model = setup
    with ResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, N_NEW, keep_logits=True)
    r = Restarter(path, tmp_path / "run")
    try:
        cache = DeviceSlotCache(layout.experts, 8)
        client = IodClient(r.endpoint, expect_fingerprint=layout.fingerprint.as_dict(), reconnect_s=20)
        with StreamedExperts(client, layout, cache, owns_client=True, landing=landing) as src:
            hook = KillAfterLayer(model, src, client, lambda: list(src.ahead._futures.get(1, {}).values()), r)
            got = generate(model.with_bank(ExpertBank(src)), PROMPTS, N_NEW, keep_logits=True, observer=hook)
            stats, reconnects = src.stats().as_dict(), client.reconnects
        assert reconnects == 1
        assert same_run(got, want)
        if landing == "lazy":  # landed leases wait in the arena for their layer: void, fetched again
            assert hook.voidable > 0 and stats["voided"] >= hook.voidable
    finally:
        r.stop()


def test_arena_decoder_reads_on_while_its_daemon_restarts(setup, tmp_path):
    """Every expert in the arena: a killed daemon's arena no longer changes, so the decoder
    computes from it through the restart (bit for bit), then moves to the new daemon's arena."""
    path, layout, model = setup
    with QuantResidentExperts(layout) as resident:
        want = generate(model.with_bank(ExpertBank(resident)), PROMPTS, N_NEW, keep_logits=True)
    r = Restarter(path, tmp_path / "run")
    try:
        with open_arena(layout, r.endpoint, reconnect_s=20) as src:
            streamed = model.with_bank(ExpertBank(src))
            hook = KillAfterLayer(model, src, src.client, lambda: [], r)
            got = generate(streamed, PROMPTS, N_NEW, keep_logits=True)
            assert same_run(got, want)  # warm: every expert is in the arena now
            got = generate(streamed, PROMPTS, N_NEW, keep_logits=True, observer=hook)
            assert same_run(got, want) and hook.passes >= 3
            r.wait_restarted()
            deadline = time.monotonic() + 20
            while src.client.reconnects == 0 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert src.client.reconnects == 1
            assert same_run(generate(streamed, PROMPTS, N_NEW, keep_logits=True), want)  # on the new arena
            assert src.client.arena.name == get_status(r.daemons[1].status_endpoint)["arena"]["name"]
    finally:
        r.stop()


# -- the `moestream generate --iod` process --------------------------------------------------
CLI_PROMPT = "7,77,177,277,377"
CLI_NEW = "16"
CLI_SLOTS = 2  # of the tiny model's 16 experts: one layer's top-k, so every layer misses


def start_generate(model: Path, endpoint: str, *extra: str) -> subprocess.Popen:
    args = [sys.executable, "-m", "moestream", "generate", "--model", str(model), "--iod", endpoint,
            "--prompt-ids", CLI_PROMPT, "-n", CLI_NEW, "--json", "--no-progress", *extra]
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def freeze_mid_generation(proc: subprocess.Popen, status_endpoint: str, requests: int = 30) -> None:
    """SIGSTOP the decoder once the daemon has served `requests` experts (prefill and a few tokens)."""
    deadline = time.monotonic() + 60
    while get_status(status_endpoint)["requests"] < requests:
        assert proc.poll() is None, f"decoder ended before the fault: {proc.communicate()}"
        assert time.monotonic() < deadline, "decoder made no progress"
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGSTOP)


def test_generate_process_survives_kill_and_restart(tiny_model, tmp_path, capsys):
    assert cli.main(["--model", str(tiny_model), "--resident", "--prompt-ids", CLI_PROMPT, "-n", CLI_NEW, "--json",
                     "--no-progress"]) == 0
    want = json.loads(capsys.readouterr().out)
    run_dir = tmp_path / "run"
    # an arena of a few experts: misses go on after the fault (with all of them in the arena the
    # decoder would finish from the dead daemon's arena without asking: see the test above)
    daemons = [spawn_daemon(tiny_model, run_dir=run_dir, arena_slots=CLI_SLOTS)]
    proc = start_generate(tiny_model, daemons[0].endpoint, "--reconnect-wait", "30")
    try:
        freeze_mid_generation(proc, daemons[0].status_endpoint)
        daemons[0].proc.kill()  # the decoder is frozen mid-step: requests in flight, leases held
        daemons[0].proc.wait()
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.5)  # the decoder finds the daemon gone and keeps trying
        daemons.append(spawn_daemon(tiny_model, run_dir=run_dir, arena_slots=CLI_SLOTS))
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        got = json.loads(out)
        assert got["tokens"] == want["tokens"] and got["finish"] == want["finish"]
        assert int(CLI_NEW) >= len(got["tokens"][0]) > 10  # the fault came mid-generation
        assert get_status(daemons[1].status_endpoint)["requests"] > 0
        assert "reconnected to moestream-iod" in err
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.communicate()
        for d in daemons:
            d.stop()


def test_generate_process_gives_up_with_a_clear_error(tiny_model, tmp_path):
    d = spawn_daemon(tiny_model, run_dir=tmp_path / "run", arena_slots=CLI_SLOTS)
    proc = start_generate(tiny_model, d.endpoint, "--reconnect-wait", "1")
    try:
        freeze_mid_generation(proc, d.status_endpoint, requests=16)
        d.proc.kill()
        d.proc.wait()
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
        waited = time.monotonic() - t0
        assert proc.returncode == 1, err
        last = err.strip().splitlines()[-1]
        assert last.startswith("moestream generate: ") and "did not come back within 1s" in last, err
        assert "Traceback" not in err
        assert waited < 8  # the 1 s wait and a poll period, not the 60 s fetch timeout
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.communicate()
        d.stop()
        remove_arena_of(d.pid)  # SIGKILLed, and no daemon came after it to remove its arena


def remove_arena_of(pid: int) -> None:
    for p in Path("/dev/shm").glob(f"moestream-{pid}-*"):
        p.unlink(missing_ok=True)
