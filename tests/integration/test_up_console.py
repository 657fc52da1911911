"""`pdkv up`'s console (pdkv.cli.up_console) over a real Supervisor (`pdkv bootstrap` processes) and pdkv's real
proxy in front of stub engines: the parts, then the live view read from the proxy, the footer and the events."""

from __future__ import annotations

import io
import sys

from rich.console import Console
from rich.text import Text
from support.ports import free_port
from support.proxy_stubs import Deployment
from support.waiting import wait_for

from pdkv.cli.up_console import UpConsole
from pdkv.deploy import RestartPolicy, Supervisor
from pdkv.deploy.plan.launch import Launch


def _bootstrap(name: str) -> Launch:
    port = free_port()
    argv = [sys.executable, "-m", "pdkv", "bootstrap", "--host", "127.0.0.1", "--port", str(port)]
    return Launch(name=name, argv=argv, env={}, url=f"http://127.0.0.1:{port}")


def _text(screen: UpConsole) -> str:
    out = Console(file=io.StringIO(), width=100, record=True, color_system=None)
    out.print(screen.render())
    return out.export_text()


def test_the_console_shows_the_parts_then_the_view_the_footer_and_the_events(tmp_path) -> None:
    plans = [_bootstrap("bootstrap-0"), _bootstrap("bootstrap-1")]
    with Supervisor(plans, tmp_path / "logs", restart=[RestartPolicy("no"), RestartPolicy("no")]) as sup, Deployment() as dep:
        screen = UpConsole(sup, {"bootstrap-0": "bootstrap", "bootstrap-1": "bootstrap"}, interval=0.2,
                           out=Console(file=io.StringIO(), width=100))  # fmt: skip
        screen.start()
        try:
            sup.start_all(60)
            before = _text(screen)
            assert "requests" not in before  # no view before the deployment is ready
            for plan, proc in zip(plans, sup.procs):
                assert f" {plan.name}  ready  {proc.pid} " in before and plan.url in before
            screen.serve(dep.url, [Text("ready. Send a request:")])
            screen.note(Text("12:00:00 bootstrap-1 exited with code 1 (log: /x/bootstrap-1.log)"))
            wait_for(lambda: "prefill-0" in _text(screen), 10, "the view under the parts")
            shown = _text(screen)
        finally:
            screen.stop()
    lines = shown.splitlines()
    assert lines[0].startswith("pdkv up   proxy " + dep.url + " up")
    assert any(line.split()[:2] == ["prefill-0", "up"] for line in lines) and any(line.split()[:2] == ["decode-0", "up"] for line in lines)
    assert any(line.startswith("requests ") for line in lines) and any(line.startswith("transfers ") for line in lines)
    assert lines[-2:] == ["ready. Send a request:", "12:00:00 bootstrap-1 exited with code 1 (log: /x/bootstrap-1.log)"]
    assert len(lines) <= 40


def test_notes_and_draws_from_many_threads_at_once(tmp_path) -> None:
    import threading

    from pdkv.cli.up_console import NOTES

    sup = Supervisor([_bootstrap("bootstrap-0")], tmp_path / "logs")
    screen = UpConsole(sup, {"bootstrap-0": "bootstrap"}, out=Console(file=io.StringIO(), width=100))
    errors: list[BaseException] = []

    def noting(i: int) -> None:
        try:
            for n in range(200):
                screen.note(Text(f"thread {i} note {n}"))
                if n % 20 == 0:
                    _text(screen)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=noting, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    notes = [line for line in _text(screen).splitlines() if line.startswith("thread ")]
    assert len(notes) == NOTES and all(line.endswith("note 199") for line in notes[-1:])
