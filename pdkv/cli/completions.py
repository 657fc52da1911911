"""Writes completions/ from the CLI itself: `python -m pdkv.cli.completions`."""

from __future__ import annotations

from pathlib import Path

SHELLS = {"bash": "pdkv.bash", "zsh": "_pdkv", "fish": "pdkv.fish"}


def render(shell: str) -> str:
    from typer._completion_shared import get_completion_script

    return get_completion_script(prog_name="pdkv", complete_var="_PDKV_COMPLETE", shell=shell)


def write(directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for shell, name in SHELLS.items():
        path = directory / name
        path.write_text(render(shell))
        written.append(path)
    return written


if __name__ == "__main__":
    for path in write(Path(__file__).resolve().parents[2] / "completions"):
        print(path)
