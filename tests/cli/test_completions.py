from __future__ import annotations

from pathlib import Path

from pdkv.cli.completions import SHELLS, render

COMPLETIONS = Path(__file__).resolve().parents[2] / "completions"


def test_completion_scripts_are_current():
    for shell, name in SHELLS.items():
        committed = (COMPLETIONS / name).read_text()
        assert committed == render(shell), f"completions/{name} is stale: run python -m pdkv.cli.completions"
