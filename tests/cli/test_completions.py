from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from pdkv.cli.completions import SHELLS, command_tree, render

COMPLETIONS = Path(__file__).resolve().parents[2] / "completions"


def test_completion_scripts_are_current():
    tree = command_tree()
    for shell, name in SHELLS.items():
        committed = (COMPLETIONS / name).read_text()
        assert committed == render(shell, tree), f"completions/{name} is stale: run python -m pdkv.cli.completions"


def test_every_registered_command_is_in_the_tree():
    from pdkv.cli.app import COMMANDS

    assert set(COMMANDS) <= set(command_tree()["commands"])


def _complete(*words: str) -> list[str]:
    line = " ".join(words)
    script = (
        f"source {COMPLETIONS / 'pdkv.bash'}; COMP_WORDS=({line}); COMP_CWORD={len(words) - 1}; _pdkv; "
        'printf "%s\\n" "${COMPREPLY[@]}"'
    )
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True).stdout.split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_bash_completes_commands_subcommands_and_options():
    assert _complete("pdkv", "mo") == ["model"]
    assert _complete("pdkv", "model", "tiny", "--s") == ["--seed", "--std"]
    assert _complete("pdkv", "bench", "--layers", "3", "r") == ["run"]
    assert "--prompt-tokens" in _complete("pdkv", "plan", "--pr")
