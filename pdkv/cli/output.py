"""Rendering shared by every command: JSON for scripts, rich for people."""

from __future__ import annotations

import sys
from typing import Any

import msgspec
from rich.console import Console

console = Console()
err_console = Console(stderr=True)


def to_builtins(obj: Any) -> Any:
    return msgspec.to_builtins(obj)


def print_json(obj: Any) -> None:
    """Write `obj` (a msgspec Struct, dict or list) as one JSON document on stdout."""
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode() + "\n")
    sys.stdout.flush()
