"""`moestream bench capped`: the pure parts (caps, budget split, ideal LRU, routing spread, disk
counters, report), the clear errors, the cgroup wrapper; one small real run where this machine
lets us create memory cgroups (root, a memory hierarchy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from moestream.decoder.bench.capped import main as bc
from moestream.decoder.bench.capped import plan as plan
from moestream.decoder.bench.capped import report as report
from moestream.decoder.bench.capped import cgroup_run as cg
from moestream.decoder.bench.capped import host_counters as hc
from moestream.decoder.bench.capped import moestream_run as msr
from moestream.decoder.bench.capped import routing_replay as rr

MiB = 1 << 20


# -- caps and the budget split ---------------------------------------------------------------
def test_caps_are_shares_of_the_file_or_sizes():
    assert plan.parse_cap("50%", 1000) == 500
    assert plan.parse_cap("12.5 %", 8000) == 1000
    assert plan.parse_cap("1.5GiB", 1) == 3 << 29
    assert plan.parse_cap("512M", 1) == 512 * MiB


@pytest.mark.parametrize("text", ["0%", "150%", "lots", "-5%", "0"])
def test_bad_caps_say_what_is_accepted(text):
    with pytest.raises(plan.UsageError, match="--memory"):
        plan.parse_cap(text, 1000)


def test_split_gives_the_arena_what_is_left_in_whole_slots():
    s = plan.split_budget(1000 * MiB, 300 * MiB, 60 * MiB, 64 * MiB, 4 * MiB, min_slots=4, max_slots=1000)
    assert s.slots == (1000 - 300 - 60 - 64) // 4 == 144
    assert s.arena_bytes == 144 * 4 * MiB
    assert s.daemon_budget == 1000 * MiB - 300 * MiB - 64 * MiB  # what `moestream-iod --memory` gets
    assert "144 slots" in s.describe(1440) and "10.0% of the experts" in s.describe(1440)


def test_split_never_makes_more_slots_than_experts():
    assert plan.split_budget(10 << 30, MiB, MiB, MiB, MiB, min_slots=4, max_slots=128).slots == 128


def test_a_cap_too_small_for_the_processes_names_the_numbers():
    with pytest.raises(plan.UsageError) as e:
        plan.split_budget(400 * MiB, 300 * MiB, 60 * MiB, 64 * MiB, 4 * MiB, min_slots=4, max_slots=100, label="25%")
    msg = str(e.value)
    assert "cap 25%" in msg and "300MiB" in msg and "60MiB" in msg and "at least 4 slots" in msg


# -- ideal LRU and routing spread ------------------------------------------------------------
TRACE = [[(0, 0), (0, 1), (1, 0)],  # the prefill: one step
         [(0, 0), (1, 1)],
         [(0, 2), (1, 0)]]


def test_ideal_lru_counts_the_decode_steps_misses_per_token():
    # Per layer, capacity 3: prefill misses 00 01 10; then 00 hit, 11 miss (evicts 01),
    # 02 miss (evicts 10), 10 miss (evicts 00).
    r = rr.ideal_lru(TRACE, 3, expert_bytes=1000.0)
    assert (r["prefill_misses"], r["hits"], r["misses"], r["decode_steps"]) == (3, 1, 3, 2)
    assert r["missed_bytes_per_token"] == 3 * 1000.0 / 2
    assert r["hit_rate"] == 0.25


def test_ideal_lru_takes_a_layer_larger_than_the_arena_in_pieces():
    # One slot: the prefill's layer 0 (two experts) goes in two pieces; nothing is ever hit again.
    r = rr.ideal_lru(TRACE, 1, expert_bytes=1.0)
    assert (r["prefill_misses"], r["hits"], r["misses"]) == (3, 0, 4)
    assert "holds no expert" in rr.ideal_lru(TRACE, 0, expert_bytes=1.0)["error"]


def test_the_arena_policy_keeps_a_hot_expert_an_lru_cycles_out():
    # Two slots, one layer. H is used three times, then every third step between new experts:
    # an LRU evicts H for the second new one each time; the decayed LFU (hotness ~2.7 against
    # 1) evicts the new ones instead and hits H every time.
    trace = [[(0, 9)], [(0, 9)], [(0, 9)], [(0, 1)], [(0, 2)], [(0, 9)], [(0, 3)], [(0, 4)], [(0, 9)]]
    lru, arena = rr.ideal_lru(trace, 2, expert_bytes=1.0), rr.arena_policy(trace, 2, expert_bytes=1.0)
    assert (lru["hits"], lru["misses"]) == (2, 6)
    assert (arena["hits"], arena["misses"]) == (4, 4) and arena["missed_bytes_per_token"] == 4 / 8
    assert "holds no expert" in rr.arena_policy(trace, 0, expert_bytes=1.0)["error"]


def test_routing_spread_over_the_decode_steps():
    s = rr.routing_spread(TRACE, n_layer=2, n_expert=4)
    assert s["mean_distinct"] == 2.0 and s["share"] == 0.5 and s["tokens"] == 3
    assert not s["narrow"]  # too short to judge


def test_a_long_run_on_few_experts_is_narrow():
    steps = [[(0, 0), (1, 0)]] + [[(0, 1), (1, 2)]] * 40
    s = rr.routing_spread(steps, n_layer=2, n_expert=4)
    assert s["mean_distinct"] == 1.0 and s["narrow"]


# -- disk counters and medians ---------------------------------------------------------------
def _phases(load: int, prefill: int, decode: int) -> dict[str, int]:
    return {"load": load, "prefill": prefill, "decode": decode}


def test_disk_counted_on_the_block_device_when_it_agrees():
    r = hc.disk_figures(_phases(5, 50 * MiB, 100 * MiB), _phases(0, 50 * MiB, 100 * MiB), 10, "auto")
    assert r["disk_source"] == "block device" and r["disk_per_token"] == 10 * MiB
    assert r["other_reads_bytes"] == 0  # the load phase is not compared (the decoder reads its libraries)


def test_disk_falls_back_to_own_counters_when_others_read_the_disk():
    block, own = _phases(0, 50 * MiB, 500 * MiB), _phases(0, 50 * MiB, 100 * MiB)
    r = hc.disk_figures(block, own, 10, "auto")
    assert r["disk_source"].startswith("/proc/PID/io") and "other processes" in r["disk_source"]
    assert r["disk_per_token"] == 10 * MiB and r["block_per_token"] == 50 * MiB
    assert r["other_reads_bytes"] == 400 * MiB
    assert hc.disk_figures(block, own, 10, "block")["disk_per_token"] == 50 * MiB


def test_no_block_device_means_own_counters():
    r = hc.disk_figures({"load": None, "prefill": None, "decode": None}, _phases(0, 1, 20), 2, "auto")
    assert r["disk_source"] == "/proc/PID/io" and r["disk_per_token"] == 10 and r["other_reads_bytes"] is None


def test_medians_skip_failed_runs_and_keep_agreed_labels():
    m = report.medians([{"tok": 1.0, "src": "a"}, {"tok": 3.0, "src": "a"}, {"error": "boom"}, {"tok": 2.0, "src": "a"}])
    assert m["tok"] == 2.0 and m["src"] == "a" and m["errors"] == ["boom"]
    assert "src" not in report.medians([{"src": "a"}, {"src": "b"}])


# -- the report ------------------------------------------------------------------------------
def _run(tok_s: float, disk: float, **extra) -> dict:
    return {"decode_tok_s": tok_s, "prefill_s": 0.5, "decode_s": 3.0, "disk_per_token": disk,
            "block_per_token": disk, "proc_disk_per_token": disk, "disk_source": "block device",
            "load_disk_bytes": 1 << 30, "prefill_disk_bytes": 300 * MiB, "peak_memory": 900 * MiB, "oom_kills": 0,
            **extra}


def _result(with_llamacpp: bool) -> dict:
    split = plan.split_budget(1 << 30, 400 * MiB, 60 * MiB, 64 * MiB, 4 * MiB, 4, 1024)
    ms = _run(5.0, 20e6, stall_s=1.0, fetched_bytes=200e6, compute_s=2.0, arena_slots=125, daemon_hit_rate=0.4,
              daemon_read_bytes=250e6, lru={"capacity": 125, "hit_rate": 0.5, "missed_bytes_per_token": 10e6},
              lru_missed_per_token=10e6, spread={"mean_distinct": 40.0, "share": 0.625})
    runs = {"moestream": [ms, {"error": "moestream generate exited with code -9: OOM-killed"}],
            "llamacpp": [_run(2.5, 80e6)] if with_llamacpp else []}
    out = {"model": "/tmp/m.gguf", "file_bytes": 2 << 30, "dense_bytes": 50 * MiB, "expert_bytes": 4 << 30,
           "n_layer": 16, "n_expert": 64, "top_k": 4, "tokens": 32, "prompt_tokens": 22, "threads": 2, "repeat": 2,
           "cold": True, "prefetch": 1, "cgroup": "v1 under /sys/fs/cgroup/memory/x", "disk": "vda",
           "daemon_sizing": "--memory", "direct": True, "notes": [], "sampling": "temperature 1.0, seed 0",
           "warmup": {"decoder_bytes": 400 * MiB, "daemon_bytes": 60 * MiB, "decode_tok_s": 6.0,
                      "spread": {"mean_distinct": 3.0, "n_expert": 64, "share": 3 / 64, "tokens": 32, "narrow": True}},
           "bandwidth": {"bytes": 256 * MiB, "seconds": 0.128, "bytes_per_s": 2e9, "ranges": 300, "depth": 32}}
    out["caps"] = [report.summarize("50%", split, runs, out)]
    return out


def test_report_shows_both_sides_the_ratios_and_the_failures():
    r = _result(with_llamacpp=True)
    cap = r["caps"][0]
    assert cap["ratio"] == 2.0 and cap["disk_bound_tok_s"] == 200.0
    assert cap["moestream"]["disk_over_lru"] == 2.0 and cap["llamacpp"]["disk_over_lru"] == 8.0
    assert cap["moestream"]["bound_tok_s"] == 200.0 and cap["moestream"]["over_bound"] == 5.0 / 200.0
    text = report.format_report(r)
    for needle in ("cap 50% = 1GiB", "llama.cpp", "2.00", "disk MB/token (decode)", "narrow",
                   "different tokens", "OOM-killed", "ideal LRU (125 slots", "disk bound 200.00 tok/s", "40.0 of 64"):
        assert needle in text, needle
    json.dumps(r)  # --json prints it


def test_the_forecast_is_also_given_at_the_runs_own_disk_speed():
    r = _result(with_llamacpp=True)
    r["caps"][0]["forecast"] = {"tok_s": 2.5, "basis": "b", "tok_s_at_run_disk": 4.0, "run_disk_bytes_per_s": 1.3e9}
    text = report.format_report(r)
    assert "measured / forecast 2.00" in text  # 5.0 tok/s measured
    assert "the runs' own disk speed (1.30 GB/s" in text and "4.00 tok/s, measured / that 1.25" in text


def test_the_bound_takes_the_uncapped_compute_rate_when_measured():
    r = _result(with_llamacpp=True)
    r["uncapped"] = {"moestream": {"decode_tok_s": 8.0}, "llamacpp": {"decode_tok_s": 400.0}, "ratio": 0.02}
    cap = report.summarize("50%", plan.Split(**r["caps"][0]["split"]), {"moestream": r["caps"][0]["moestream"]["runs"],
                                                                   "llamacpp": r["caps"][0]["llamacpp"]["runs"]}, r)
    assert cap["moestream"]["bound_tok_s"] == 8.0 and cap["llamacpp"]["bound_tok_s"] == 200.0
    r["caps"] = [cap]
    assert "uncapped, warm" in report.format_report(r)


def test_uncapped_alone_runs_no_cap_and_measures_no_disk(tiny_model):
    args = bc.build_parser().parse_args(["--model", str(tiny_model), "--uncapped"])
    assert bc.check_args(args)[1] == []
    args = bc.build_parser().parse_args(["--model", str(tiny_model)])
    assert [text for text, _ in bc.check_args(args)[1]] == ["50%"]
    r = _result(with_llamacpp=True)
    del r["bandwidth"]
    r["caps"] = []
    r["uncapped"] = {"moestream": {"decode_tok_s": 8.0, "prefill_s": 0.25, "runs": [{"decode_tok_s": 7.5}]},
                     "llamacpp": {"decode_tok_s": 10.0, "prefill_s": 0.15, "runs": [{"decode_tok_s": 9.5}]},
                     "ratio": 0.8}
    text = report.format_report(r)
    assert "bandwidth" not in text and "moestream runs: 7.50; prefill 0.250 s" in text and "llama.cpp runs: 9.50" in text


def test_report_without_llamacpp_has_one_column():
    text = report.format_report(_result(with_llamacpp=False))
    assert "llama.cpp" not in text.split("cap 50%")[1] and "moestream" in text


# -- errors ----------------------------------------------------------------------------------
def test_a_directory_without_memory_controller_is_refused(tmp_path):
    with pytest.raises(cg.CgroupError, match="not a memory cgroup"):
        cg.find_cgroup_parent(tmp_path)
    (tmp_path / "cgroup.controllers").write_text("cpu io pids\n")
    with pytest.raises(cg.CgroupError, match="memory controller is not available"):
        cg.find_cgroup_parent(tmp_path)


def test_no_cgroup_is_one_line_and_exit_code_2(tiny_model, tmp_path, capsys):
    assert bc.main(["--model", str(tiny_model), "--memory", "1GiB", "--cgroup-parent", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a memory cgroup" in err


def test_bad_input_is_exit_code_2(tiny_model, tmp_path, capsys):
    assert bc.main(["--model", str(tmp_path / "missing.gguf")]) == 2
    assert "model not found" in capsys.readouterr().err
    assert bc.main(["--model", str(tiny_model), "--memory", "1%"]) == 2
    err = capsys.readouterr().err
    assert "smaller than the model's dense weights" in err and "KiB" in err


def test_llamacpp_missing_names_the_extra(tiny_model, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    assert bc.main(["--model", str(tiny_model), "--memory", "1GiB", "--llamacpp"]) == 2
    assert "pip install 'moestream[bench]'" in capsys.readouterr().err


def test_cold_runs_without_root_say_so_once(monkeypatch, capsys, tmp_path):
    evicted = []
    monkeypatch.setattr(bc, "drop_caches", lambda: "Permission denied")
    monkeypatch.setattr(bc, "evict_file", evicted.append)
    notes: list[str] = []
    cold = bc.Cold(True, str(tmp_path / "m.gguf"), notes)
    cold(), cold()
    assert len(notes) == 1 and notes[0].startswith("warm: could not drop caches (Permission denied)")
    assert capsys.readouterr().err.count("could not drop caches") == 1
    assert len(evicted) == 2  # the model file's own pages still go before every run


def test_the_wrapper_joins_the_group_before_exec(tmp_path):
    group = object.__new__(cg.MemoryCgroup)  # the wrapper only needs the path: no cgroup here
    group.path = tmp_path
    out = subprocess.run(group.wrap(["sh", "-c", "echo $$"]), capture_output=True, text=True, check=True).stdout
    assert (tmp_path / "cgroup.procs").read_text().strip() == out.strip()  # exec kept the pid


# -- a real run, where memory cgroups can be made ----------------------------------------------
def _writable_memory_cgroup() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        cg.MemoryCgroup(cg.find_cgroup_parent(), None, "probe").remove()
    except (cg.CgroupError, OSError):
        return False
    return True


@pytest.mark.skipif(not _writable_memory_cgroup(), reason="needs root and a writable memory cgroup")
def test_end_to_end_under_a_cap(tiny_model, capsys):
    parent = cg.find_cgroup_parent()
    code = bc.main(["--model", str(tiny_model), "--memory", "1GiB", "-n", "4", "--prompt-tokens", "5",
                    "--repeat", "1", "--warm", "--json"])
    out = capsys.readouterr()
    assert code == 0, out.err
    r = json.loads(out.out)
    cap = r["caps"][0]
    ms = cap["moestream"]
    assert not ms["errors"] and ms["new_tokens"] >= 1 and ms["decode_tok_s"] > 0
    assert ms["arena_slots"] == cap["split"]["slots"] or r["daemon_sizing"] == "--memory"
    assert 0 < ms["peak_memory"] <= 1 << 30 and ms["oom_kills"] == 0
    assert r["direct"] and ms["daemon_reads"] == "O_DIRECT"  # the daemon said it reads with O_DIRECT
    assert r["warmup"]["decoder_bytes"] > 0 and r["warmup"]["daemon_bytes"] > 0
    assert ms["daemon_cpu_s"] >= 0  # the daemon's CPU in the decode steps, sampled from /proc
    assert not [p for p in parent.path.iterdir() if p.name.startswith(f"moestream-bench-{os.getpid()}-")]


# -- O_DIRECT on the daemon side ---------------------------------------------------------------
def _plan(tmp_path, **kw) -> plan.Plan:
    base = {"model": "/m.gguf", "prompt": [1, 2], "tokens": 4, "threads": 1, "prefetch": 1, "temperature": 0.0,
            "seed": 0, "block_stat": None, "workdir": tmp_path, "timeout_s": 10.0, "decoder_args": [],
            "extra_bufts": False, "daemon_memory_flag": True, "disk_counter": "auto"}
    return plan.Plan(**{**base, **kw})


def test_the_daemon_reads_with_o_direct_unless_told_not_to(tmp_path):
    split = plan.split_budget(1 << 30, 100 * MiB, 50 * MiB, 64 * MiB, 4 * MiB, 4, 1024)
    cmd = msr.daemon_command(_plan(tmp_path), tmp_path, split)
    assert "--direct" in cmd and "--no-direct" not in cmd
    assert cmd[cmd.index("--memory") + 1] == str(split.daemon_budget)
    assert "--no-direct" in msr.daemon_command(_plan(tmp_path, direct=False), tmp_path, None)
    assert bc.build_parser().parse_args(["--model", "m"]).direct
    assert not bc.build_parser().parse_args(["--model", "m", "--no-direct"]).direct


def test_help_says_why_o_direct(capsys):
    with pytest.raises(SystemExit):
        bc.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--no-direct" in text and "the same bytes cached twice under one cap" in text


def test_a_bad_headroom_is_refused_before_any_run(tiny_model, capsys):
    assert bc.main(["--model", str(tiny_model), "--memory", "1GiB", "--headroom", "lots"]) == 2
    assert "--headroom 'lots'" in capsys.readouterr().err


# -- workloads, Belady, readahead --------------------------------------------------------------
def test_belady_never_misses_more_than_lru_and_is_reported_beside_it():
    steps = [[(0, e) for e in (0, 1, 2)]] + [[(0, e)] for e in (0, 3, 0, 1, 3, 0, 2, 1)]
    r = rr.ideal_lru(steps, 3, expert_bytes=10.0)
    # LRU over the decode steps (after 0 1 2): 0 hit, 3 miss (evicts 1), 0 hit, 1 miss (evicts 2), 3 hit, 0 hit,
    # 2 miss (evicts 1), 1 miss (evicts 3): 4 misses. Belady: 3 evicts 2 (used last), 2 evicts a key never
    # used again: 2 misses.
    assert (r["misses"], r["belady_misses"]) == (4, 2)
    assert r["belady_missed_bytes_per_token"] == 2 * 10.0 / 8


def test_routing_kinds_and_their_errors(tmp_path):
    from moestream.decoder.bench.capped import routing as cr

    assert cr.parse_routing(None).kind == "sampled"
    assert cr.parse_routing(["curve", "qwen3-235b"]).forced
    assert cr.prefetch_for(cr.parse_routing(["curve", "qwen3-235b"]), None) == 0
    assert cr.prefetch_for(cr.parse_routing(["chain"]), None) == 1
    assert cr.sampling_for(cr.parse_routing(["chain"]), "auto") == "greedy"
    for words, msg in ((["uniform"], "choose one of"), (["curve"], "needs one argument"),
                       (["curve", "gpt-9"], "known curves"), (["trace", str(tmp_path / "no.npy")], "not found"),
                       (["chain", "x"], "takes no argument")):
        with pytest.raises(plan.UsageError, match=msg):
            cr.parse_routing(words)


def test_readahead_is_set_for_a_run_and_restored(tmp_path):
    f = tmp_path / "read_ahead_kb"
    f.write_text("8192\n")
    with hc.ReadAhead(f, 128) as ra:
        assert ra.current() == 128 and ra.why is None
    assert f.read_text().strip() == "8192"
    with hc.ReadAhead(f, None) as ra:  # leave it as it is
        assert ra.current() == 8192
    stat = tmp_path / "dev" / "stat"
    stat.parent.mkdir()
    (stat.parent / "queue").mkdir()
    (stat.parent / "queue" / "read_ahead_kb").write_text("4096")
    assert hc.read_ahead_file(stat) == stat.parent / "queue" / "read_ahead_kb"
    assert hc.read_ahead_file(None) is None


def test_the_sampler_counts_a_process_cpu_time():
    sampler = hc.Sampler(None, {"me": os.getpid()})
    t0 = os.times()
    while os.times().user - t0.user < 0.2:
        sum(range(10_000))
    sampler.stop()
    assert sampler.cpu_delta(0, len(sampler.samples) - 1, "me") >= 0.15
    assert sampler.cpu_delta(0, 0, "me") == 0 and sampler.cpu_delta(0, 1, "nobody") is None


def test_the_report_gives_the_daemons_cpu_per_read():
    note = report._cpu_note({"daemon_cpu_s": 1.02, "daemon_cpu_ms_per_read": 0.81})
    assert note == "; daemon CPU in the decode 1.02 s (0.81 ms an expert read)"
    assert report._cpu_note({}) == "" and "ms an expert read" not in report._cpu_note({"daemon_cpu_s": 0.5})


def test_the_forecast_takes_the_arena_the_daemon_made(tiny_model, tmp_path):
    """The daemon keeps a margin beside its own memory, so it may make fewer slots than the split
    planned: the forecast replays the routing on the slots it made (the split's without a run)."""
    from moestream.common.layout import ModelLayout
    from moestream.common.traces import load_trace
    from moestream.tools.plan import shape_of

    layout = ModelLayout(tiny_model)
    s = shape_of(layout)
    rng = np.random.default_rng(0)
    steps = [[[layer, int(e)] for layer in range(s.moe_layers) for e in rng.choice(s.n_expert, s.top_k, False)]
             for _ in range(40)]  # a spread routing: more slots hit more
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"n_layer": s.moe_layers, "n_expert": s.n_expert, "steps": steps}))
    split = plan.split_budget(1000 * MiB, 300 * MiB, 60 * MiB, 64 * MiB, s.slot_bytes, min_slots=4,
                              max_slots=s.n_blobs)
    out = {"bandwidth": {"bytes_per_s": 1e9, "depth": 32}, "bandwidth_demand": {"bytes_per_s": 1e9, "depth": 12}}
    planned = bc.cap_forecast(layout, split, {"trace": str(trace)}, out, {"moestream": None}, 10.0)
    made = bc.cap_forecast(layout, split, {"trace": str(trace)}, out, {"moestream": {"arena_slots": 5.0}}, 10.0)
    assert planned["slots"] == split.slots and made["slots"] == 5
    want = rr.arena_policy(load_trace(trace), 5, s.expert_bytes)
    assert made["hit_rate"] == want["hit_rate"] < planned["hit_rate"]
    assert made["tok_s"] < planned["tok_s"] and "(5 slots)" in made["basis"]


TOUCHER = """
import mmap, sys
f = open(sys.argv[1], "rb")
m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
def touch(n):
    return sum(m[i] for i in range(0, n, 4096))
touch(len(m))  # the load: all 48 MiB
print("loaded", flush=True)
sys.stdin.readline()  # serving has begun
for _ in range(20):
    touch(4 << 20)  # the work: its first 4 MiB only
print("worked", flush=True)
sys.stdin.readline()
"""


def test_the_sampler_counts_the_file_pages_used_once_serving_began(tmp_path):
    """A process maps 48 MiB of a file and reads it all while loading, then only 4 MiB of it:
    its need counts the 4 MiB it still uses (and its interpreter's few), not the 48."""
    data = tmp_path / "weights.bin"
    data.write_bytes(os.urandom(48 << 20))
    p = subprocess.Popen([sys.executable, "-c", TOUCHER, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "loaded"
        serving = threading.Event()
        sampler = hc.Sampler(None, {"proc": p.pid}, serving.is_set, working_set=True)
        serving.set()
        while sampler.start is None:
            time.sleep(0.01)
        p.stdin.write("\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "worked"
        sampler.stop()
        anon, file = hc.proc_mem_parts(p.pid)
        p.stdin.write("\n")
        p.stdin.flush()
        p.wait(10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert file >= 48 << 20  # still mapped and resident: the last RssFile would count it all
    used = sampler.file_used["proc"]
    assert 4 << 20 <= used < 20 << 20, used
    assert sampler.need("proc") == sampler.anon_peak["proc"] + used
    plain = hc.Sampler(None, {"me": os.getpid()})  # without working_set: the last RssFile
    plain.stop()
    assert plain.need("me") == plain.anon_peak["me"] + plain.file_last["me"] and "me" not in plain.file_used


def test_the_report_gives_each_process_reads_in_the_decode():
    """The decoder's own disk reads in the decode (file pages it first touches, or re-reads when
    the cap reclaimed them) apart from the daemon's, per decoded token."""
    split = plan.split_budget(1 << 30, 400 * MiB, 60 * MiB, 64 * MiB, 4 * MiB, 4, 1024)
    reads = {"load": {"daemon": 1, "decoder": 300e6}, "decode": {"daemon": 310e6, "decoder": 62e6}}
    ms = _run(5.0, 12e6, decode_s=3.0, stall_s=1.0, new_tokens=32, own_reads=reads)
    r = _result(with_llamacpp=False)
    r["caps"] = [report.summarize("50%", split, {"moestream": [ms], "llamacpp": []}, r)]
    cap = r["caps"][0]["moestream"]
    assert cap["decoder_reads_per_token"] == 2e6 and cap["daemon_reads_per_token"] == 10e6  # over 31 steps
    assert "own reads in the decode: decoder 2.00 MB/token" in report.format_report(r)
    assert "decoder_reads_per_token" not in report._flat(_run(5.0, 12e6))  # runs without the counters


def test_the_decode_reads_end_with_the_decode_not_the_process():
    """The decoder's reads after its last step (its exit faulting back paged-out library pages) are
    not decode reads: llama.cpp's side stops counting at its last token too."""
    from moestream.decoder.bench.capped.moestream_run import _moestream_disk

    sampler = object.__new__(hc.Sampler)  # its samples only: no thread, no processes
    mb = 1 << 20
    # t: 0 load, 1 first request, 1-3 prefill (2 s), 3-7 decode (4 s, 10 MB a second), 9 the exit
    reads = {0: 0, 1: 50, 2: 60, 3: 70, 4: 80, 5: 90, 6: 100, 7: 110, 8: 110, 9: 170, 10: 170}
    sampler.samples = [(float(t), reads[t] * mb, {"decoder": reads[t] * mb, "daemon": 0}) for t in range(11)]
    sampler.start = 1.0
    disk = _moestream_disk(sampler, prefill_s=2.0, decode_s=4.0, decode_tokens=4, mode="block")
    assert disk["own_reads"]["decode"]["decoder"] == 40 * mb  # not the exit's 60
    assert disk["disk_per_token"] == 10 * mb
