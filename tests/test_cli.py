"""The `moestream` dispatcher, and the package boundaries DESIGN.md draws."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from moestream.bench import BENCHES
from moestream.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [[name, "--help"] for name in COMMANDS if name != "bench"]
                         + [["bench", name, "--help"] for name in BENCHES])
def test_every_subcommand_explains_itself(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_unknown_command_is_refused(capsys):
    assert main(["no-such-command"]) == 2
    assert "unknown command 'no-such-command'" in capsys.readouterr().err


def _imports(folder: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                mod = node.module or ""
                names.add(("." * node.level) + mod)
    return names


def _touches(names: set[str], package: str) -> bool:
    return any(package in n.split(".") or n.startswith(f"..{package}") for n in names)


def test_daemon_and_decoder_meet_only_in_common():
    assert not _touches(_imports("iod"), "decoder")
    assert not _touches(_imports("decoder"), "iod")
    assert not _touches(_imports("common"), "decoder") and not _touches(_imports("common"), "iod")


def test_the_contract_and_the_daemon_never_import_the_authoring_tools():
    assert not _touches(_imports("common"), "authoring") and not _touches(_imports("iod"), "authoring")


def test_status_and_the_daemon_run_without_torch():
    code = ("import sys, moestream.cli, moestream.tools.status, moestream.iod.main, moestream.iod.server; "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
