"""One memory budget: `moestream-iod --memory SIZE|N%`, sizes with percentages, `moestream inspect`'s sizing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from moestream.common import units
from moestream.tools.inspect import describe, format_text
from moestream.common.layout import ModelLayout
from moestream.tools.status import get_status
from moestream.iod.config import ConfigError, load_config, resolve_slots

MiB = 1 << 20


def test_percent_sizes_need_a_total():
    assert units.parse_size("50%", percent_of=1000) == 500
    assert units.parse_size(" 12.5 % ", percent_of=800) == 100
    assert units.parse_size("2GiB", percent_of=1000) == 2 << 30  # plain sizes still work
    with pytest.raises(ValueError, match="bad size"):
        units.parse_size("50%")  # where nothing says what of
    for bad in ("0%", "150%"):
        with pytest.raises(ValueError, match="percentage"):
            units.parse_size(bad, percent_of=1000)


@pytest.mark.parametrize("n", [0, 812, 4096, 4_116_480, 1 << 30, 1_181_116_006, 3 << 40])
def test_format_size_rounds_up_when_asked(n):
    assert units.parse_size(units.format_size(n, up=True)) >= n
    assert units.format_size(4096) == "4KiB" and units.format_size(3 * MiB // 2) == "1.5MiB"


def test_memory_option_and_config_key(tmp_path):
    assert load_config(["--model", "m", "--memory", "3GiB"]).memory == 3 << 30
    assert load_config(["--model", "m", "--memory", "50%"]).memory == units.physical_memory() // 2
    toml = tmp_path / "iod.toml"
    toml.write_text('model = "m"\nmemory = "25%"\n')
    assert load_config(["--config", str(toml)]).memory == units.physical_memory() // 4
    assert load_config(["--config", str(toml), "--arena-slots", "8"]).memory is None  # the CLI's sizing wins
    toml.write_text('model = "m"\narena_bytes = "1GiB"\n')
    assert load_config(["--config", str(toml), "--memory", "2GiB"]).arena_bytes is None


@pytest.mark.parametrize("toml,match", [
    ('memory = "2GiB"\narena_bytes = "1GiB"', "give one of memory, arena_bytes, arena_slots, not memory and arena_bytes"),
    ('memory = "lots"', "memory: bad size 'lots'"),
    ('memory = "120%"', "percentage must be in"),
    ("now_reserve = 1.0", r"now_reserve must be a share in \[0, 1\)"),
    ('now_reserve = "half"', "now_reserve must be float"),
])
def test_bad_budget_configs_are_one_line(tmp_path, toml, match):
    (tmp_path / "t.toml").write_text(f'model = "m"\n{toml}\n')
    with pytest.raises(ConfigError, match=match) as e:
        load_config(["--config", str(tmp_path / "t.toml")])
    assert "\n" not in str(e.value)


def test_memory_and_arena_options_exclude_each_other_on_the_cli(capsys):
    with pytest.raises(SystemExit) as e:
        load_config(["--model", "m", "--memory", "1GiB", "--arena-slots", "4"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def test_slots_from_a_budget():
    cfg = load_config(["--model", "m", "--memory", "100MiB"])
    assert resolve_slots(cfg, MiB, 1000, overhead_bytes=40 * MiB, min_slots=4) == 60
    assert resolve_slots(cfg, MiB, 10, overhead_bytes=40 * MiB, min_slots=4) == 10  # never more than experts
    with pytest.raises(ConfigError) as e:
        resolve_slots(cfg, 20 * MiB, 1000, overhead_bytes=40 * MiB, min_slots=4)
    assert str(e.value) == ("memory 100MiB is too small: the daemon itself uses 40MiB, which leaves room for 3 expert "
                            "slots of 20MiB, and it needs at least 4; give --memory 120MiB or more")


def test_daemon_refuses_a_budget_too_small_in_one_line(tiny_model, tmp_path):
    p = subprocess.run([sys.executable, "-m", "moestream.iod.main", "--model", str(tiny_model), "--memory", "1MiB",
                        "--endpoint", f"ipc://{tmp_path}/a.sock", "--status-endpoint", f"ipc://{tmp_path}/s.sock"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "memory 1MiB is too small: the daemon itself uses" in lines[0], p.stderr


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """2 layers x 40 experts of ~0.8 MiB: 64 MiB of experts, more than a small budget holds."""
    from moestream.authoring.make_model import make_model

    return make_model(tmp_path_factory.mktemp("wide") / "wide.gguf", layers=2, experts=40, hidden=256, expert_ff=1024)


def test_daemon_sizes_its_arena_from_the_budget(wide_model, start_daemon):
    ex = ModelLayout(wide_model).experts
    probe = start_daemon(wide_model, extra_args=["--memory", "1GiB"])
    s = get_status(probe.status_endpoint)
    assert s["arena"]["n_slots"] == ex.n_layer * ex.n_expert  # a budget above all experts holds them all
    own, slot = s["memory"]["daemon_bytes"], s["arena"]["slot_bytes"]
    probe.stop()
    budget = own + 20 * slot  # its own use varies a little from start to start
    d = start_daemon(wide_model, extra_args=["--memory", str(budget)])
    m, a = get_status(d.status_endpoint)["memory"], get_status(d.status_endpoint)["arena"]
    assert m["budget"] == budget and a["n_slots"] == (budget - m["daemon_bytes"]) // slot < ex.n_layer * ex.n_expert
    assert m["daemon_bytes"] + m["arena_bytes"] <= budget
    assert "memory budget" in d.log_text()


def test_inspect_prints_sizing(make_tiny_model, capsys):
    path = make_tiny_model(arch="qwen3moe", quant="Q8_0", experts=10)
    d = describe(ModelLayout(path))
    sz = d["sizing"]
    assert sz["slot_bytes"] == d["experts"]["slot_bytes"]
    assert [(r["percent"], r["slots"]) for r in sz["budgets"]] == [(25, 5), (50, 10), (100, 20)]  # 20 experts
    assert all(r["arena_bytes"] == r["slots"] * sz["slot_bytes"] for r in sz["budgets"])
    assert all(r["memory_bytes"] > r["arena_bytes"] for r in sz["budgets"])
    text = format_text(d)
    assert "sizing" in text and "100% of experts" in text and "--memory" in text
