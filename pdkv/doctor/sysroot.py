"""Every sysfs, procfs and /dev read of the doctor, through one root (PDKV_SYS_ROOT, default "/")."""

from __future__ import annotations

import os
import re
from pathlib import Path


class SysRoot:
    """Reads files below `root` as if it were "/"; a missing or unreadable file reads as None."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"SysRoot({str(self.root)!r})"

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def read(self, rel: str) -> str | None:
        try:
            return self.path(rel).read_text(errors="replace").strip()
        except OSError:
            return None

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def listdir(self, rel: str) -> list[str]:
        """Names in a directory, sorted naturally (uverbs2 before uverbs10); [] if absent."""
        try:
            names = os.listdir(self.path(rel))
        except OSError:
            return []
        return sorted(names, key=_natural_key)


def _natural_key(name: str) -> tuple[str, int, str]:
    match = _TRAILING_NUMBER.match(name)
    return (match[1], int(match[2]), name) if match else (name, -1, name)


_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")
