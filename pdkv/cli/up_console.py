"""`pdkv up`'s console on a terminal: its parts, then the live view of `pdkv top`, refreshed every second.

The parts' logs go to their files only. Events (a part that exits, restarts or gives up; autoscale steps)
show as the last few lines under the view, a part that exits with its last log line and its log's path.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from pdkv.cli.live_view import ROLE_STYLE, STATE_STYLE, render_view
from pdkv.cli.output import console

if TYPE_CHECKING:
    from pdkv.deploy import Supervisor
    from pdkv.top import TopView

NOTES = 5  # the last events shown (a part that exits takes two: what happened, its log)


def _uptime(seconds: float | None) -> str:
    if seconds is None:
        return ""
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class UpConsole:
    """A rich Live over the supervisor's parts and, once `serve` is called, the deployment's live view.

    Three threads meet here: the supervisor's (notes), the reader's (the view) and Live's refresh thread
    (which draws); `_lock` guards the view, the notes and the footer."""

    def __init__(self, sup: Supervisor, kinds: dict[str, str], title: str = "pdkv up", interval: float = 1.0,
                 out: Console | None = None) -> None:
        self.sup, self.kinds, self.title, self.interval = sup, kinds, title, interval
        self._lock = threading.Lock()
        self._view: TopView | None = None  # guarded by _lock
        self._notes: collections.deque[Text] = collections.deque(maxlen=NOTES)  # guarded by _lock
        self._footer: list[Text] = []  # guarded by _lock
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None
        self._live = Live(get_renderable=self.render, console=out or console, refresh_per_second=2, transient=False)

    def start(self) -> None:
        self._live.start()

    def stop(self) -> None:
        """Stop reading and drawing; the last screen stays."""
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
        self._live.stop()

    def note(self, text: Text) -> None:
        with self._lock:
            self._notes.append(text)

    def serve(self, proxy_url: str | None, footer: Sequence[Text]) -> None:
        """The deployment is ready: show `footer` (how to use it) and, with a proxy, poll it every `interval` s."""
        with self._lock:
            self._footer = list(footer)
        if proxy_url is not None:
            self._reader = threading.Thread(target=self._read, args=(proxy_url,), name="pdkv-up-console", daemon=True)
            self._reader.start()

    def _read(self, proxy_url: str) -> None:
        from pdkv.top import DeploymentReader, view

        with DeploymentReader(proxy_url, timeout=min(2.0, self.interval * 2)) as reader:
            before = reader.read()
            while not self._stop.wait(self.interval):
                now = reader.read()
                with self._lock:
                    self._view = view(before, now)
                before = now

    def _parts(self) -> Table:
        from pdkv.top import part_rows

        table = Table(show_header=True, header_style="bold", box=None, padding=(0, 1))
        for col in ("part", "state", "pid", "uptime", "restarts", "url"):
            table.add_column(col, justify="right" if col in ("pid", "restarts") else "left")
        for row in part_rows(self.sup):
            kind = self.kinds.get(row.name, row.name.rsplit("-", 1)[0])
            table.add_row(Text(row.name, style=ROLE_STYLE.get(kind, "")), Text(row.state, style=STATE_STYLE.get(row.state, "")),
                          str(row.pid or ""), _uptime(row.uptime_s), str(row.restarts), row.url)  # fmt: skip
        return table

    def render(self) -> RenderableType:
        """What the console draws now."""
        with self._lock:
            view, notes, footer = self._view, list(self._notes), list(self._footer)
        parts = self._parts()
        if view is None:
            return Group(Text(self.title, style="bold"), parts, *footer, *notes)
        return render_view(view, self.title, parts=parts, footer=[*footer, *notes])
