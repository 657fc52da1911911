"""What an operator sees of a live CPU 1P1D (`pdkv up -f`, the tiny model, the planner on), started with its
console in a tmux pane of 100 x 40: one screen and no engine log line; numbers that move under a short load;
a part killed shown within two refreshes. A real Prometheus (Debian's `prometheus`) scrapes the same deployment
with the shipped scrape configuration and rules: every dashboard panel's query and every recording rule returns
data under the load, and `pdkv top --once --json` shows it; `PdkvPartDown` fires when P is killed and resolves
once `pdkv up` has it back.

Two changes to the shipped files, both for time: the scrape and rule intervals are 1 s (5 s shipped), and every
alert's `for` is 2 s (a test cannot wait the shipped 30 s to minutes). Targets are the deployment's free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil
import pytest
import yaml
from support.loadclient import closed_loop, mixed_cases
from support.planner_profiles import write_profile
from support.ports import free_port
from support.tiny_deployment import write_tiny_deployment
from support.waiting import wait_for, waited_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus package (scripts/setup.sh)"),
    pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="a CPU deployment: runs where no GPU is present"),
]

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
READY_TIMEOUT_S = float(os.environ.get("PDKV_E2E_UP_TIMEOUT", "600"))
BACK_TIMEOUT_S = 240.0  # P killed to P scraped again, on 2 cores


REFRESH_S = 1.0  # the console's view: one reading of the deployment a second
STATES = ("waiting", "starting", "ready", "restarting", "failed", "exited", "stopped")  # pdkv.deploy.Supervisor's
WIDTH, HEIGHT = 100, 40


@dataclass
class Live:
    """`pdkv up -f` with its console, in a tmux pane of WIDTH x HEIGHT on a tmux server of its own."""

    socket: str
    pid: int  # pdkv up's
    logs: Path
    ports: dict[str, int]
    seen: set[int] = field(default_factory=set)

    def url(self, part: str) -> str:
        return f"http://127.0.0.1:{self.ports[part]}"

    def tmux(self, *args: str) -> str:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=True, timeout=10).stdout

    def screen(self, history: bool = False, rows: bool = False) -> str:
        """What the pane shows (with `history`, everything written to it since it opened); a line wrapped at the
        pane's width is one line, unless `rows` asks for the pane's rows as they are."""
        return self.tmux("capture-pane", "-p", *(() if rows else ("-J",)), *(("-S", "-") if history else ()))

    def row(self, part: str) -> dict[str, str]:
        """The parts table's row of `part` (state, pid, uptime, restarts, url; pid and uptime empty while it is not
        running); empty if the screen has none."""
        found = re.search(rf"^ {re.escape(part)} +(?P<state>{'|'.join(STATES)}) +(?:(?P<pid>\d+) +(?P<uptime>\S+) +)?"
                          r"(?P<restarts>\d+) +(?P<url>http\S+)", self.screen(), re.MULTILINE)  # fmt: skip
        return {k: v or "" for k, v in found.groupdict().items()} if found else {}

    def look(self) -> None:
        with contextlib.suppress(psutil.NoSuchProcess):
            self.seen |= {c.pid for c in psutil.Process(self.pid).children(recursive=True)}

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                         for p in sorted(self.logs.glob("*.log")))  # fmt: skip


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    if shutil.which("tmux") is None:
        pytest.skip("needs tmux (scripts/setup.sh)")
    tmp = tmp_path_factory.mktemp("operator")
    profile = write_profile(tmp / "tiny.profile.json")
    deploy = tmp / "deploy.toml"
    ports = write_tiny_deployment(
        deploy, tiny_model, kv_events=False, proxy={"extra_args": ["--health-interval", "1"]},
        tables={
            "autoscale": {"profile": profile, "ttft_ms": 2000, "itl_ms": 10000, "interval_s": 1},
            "autoscale.prefill": {"min": 1, "max": 1},
            "autoscale.decode": {"min": 1, "max": 1},
        },
    )
    logs = tmp / "logs"
    socket = f"pdkv-test-{ports['proxy']}"  # a server of its own: it takes this process's environment
    # The pane's size is the terminal's: COLUMNS and LINES (which pytest's environment may hold) would override it.
    argv = [sys.executable, "-m", "pdkv", "up", "-f", str(deploy), "--log-dir", str(logs)]
    command = "exec env -u COLUMNS -u LINES " + shlex.join(argv)
    t0 = time.monotonic()
    subprocess.run(["tmux", "-L", socket, "-f", "/dev/null", "new-session", "-d", "-x", str(WIDTH), "-y", str(HEIGHT), command],
                   check=True, timeout=10)  # fmt: skip
    pane = subprocess.run(["tmux", "-L", socket, "display-message", "-p", "#{pane_pid}"], capture_output=True, text=True, check=True)
    running = Live(socket, int(pane.stdout), logs, ports)
    try:
        def ready() -> bool:
            assert _alive(running.pid), f"pdkv up ended:\n{running.screen(history=True)}\n{running.tails()}"
            running.look()
            return "parts ready in" in running.screen()

        waited = waited_for(ready, READY_TIMEOUT_S, "pdkv up's console to say ready")
        print(f"\npdkv up ready after {waited:.1f} s (module start {time.monotonic() - t0:.1f} s)")
        yield running
    finally:
        running.look()
        with contextlib.suppress(subprocess.SubprocessError):
            running.tmux("send-keys", "C-c")
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not _alive(running.pid), 90, "pdkv up to stop", interval=0.2)
        with contextlib.suppress(subprocess.SubprocessError):
            running.tmux("kill-server")
        for pid in running.seen | {running.pid}:  # a failed test must not leave engines on the shared cores
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()


class Prometheus:
    def __init__(self, url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.url, self.proc, self.log = url, proc, log

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10, trust_env=False)
        body = r.json()
        assert body.get("status") == "success", f"{expr}: {body}"
        return body["data"]["result"]

    def alerts(self, name: str) -> list[dict]:
        body = httpx.get(f"{self.url}/api/v1/alerts", timeout=10, trust_env=False).json()
        return [a for a in body["data"]["alerts"] if a["labels"].get("alertname") == name]


def _config_for(live: Live, into: Path) -> Path:
    """The shipped scrape configuration and rules, aimed at `live`'s ports, intervals 1 s, alerts' `for` 2 s."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    part = {"pdkv-proxy": "proxy", "pdkv-prefill": "prefill", "pdkv-decode": "decode", "pdkv-bootstrap": "bootstrap"}
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [f"127.0.0.1:{live.ports[part[job['job_name']]]}"]}]
    (into / "prometheus.yml").write_text(yaml.safe_dump(config))
    rules = re.sub(r"(?m)^(\s+for:) \S+$", r"\1 2s", (MONITORING / "pdkv-rules.yml").read_text())
    (into / "pdkv-rules.yml").write_text(rules)
    return into / "prometheus.yml"


@pytest.fixture(scope="module")
def prometheus(live: Live, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("prometheus")
    config = _config_for(live, tmp)
    port = free_port()
    log = tmp / "prometheus.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}"], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log)
    try:
        def is_ready() -> bool:
            assert proc.poll() is None, log.read_text()[-2000:]
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(f"{prom.url}/-/ready", timeout=2, trust_env=False).status_code == 200
            return False

        wait_for(is_ready, 60, "prometheus to be ready", interval=0.2)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def _dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads((MONITORING / "grafana" / "pdkv-dashboard.json").read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]


def _recording_rules() -> list[str]:
    groups = yaml.safe_load((MONITORING / "pdkv-rules.yml").read_text())["groups"]
    return [r["record"] for g in groups for r in g["rules"] if "record" in r]


def _value(result: list[dict]) -> float:
    return max((float(s["value"][1]) for s in result), default=float("nan"))


def _requests_total(screen: str) -> int:
    found = re.search(r"^requests \S+ \(total ([\d,]+)\)", screen, re.MULTILINE)
    assert found, f"no requests line on the console:\n{screen}"
    return int(found.group(1).replace(",", ""))


def test_the_console_is_one_screen_and_no_engine_log_line(live: Live) -> None:
    wait_for(lambda: "engine" in live.screen() and "requests" in live.screen(), 10, "the live view under the parts", interval=0.2)
    everything = live.screen(history=True, rows=True).rstrip().splitlines()
    print("\n".join(["", "--- the console, as the pane shows it:", *everything]))
    assert len(everything) <= HEIGHT, f"{len(everything)} lines since the pane opened"
    assert everything[0].startswith("pdkv up") and "proxy http://127.0.0.1:" in everything[0]
    for marker in ("INFO", "WARNING", "(APIServer", "EngineCore", "Traceback"):  # vLLM's log lines, and the tiny model's path
        assert not any(marker in line for line in everything), marker
    for part in ("bootstrap-0", "prefill-0", "decode-0", "proxy"):
        row = live.row(part)
        assert (row["state"], row["restarts"]) == ("ready", "0") and _alive(int(row["pid"])), (part, row)
        assert row["url"] == live.url("proxy" if part == "proxy" else part.rsplit("-", 1)[0]), row
    screen = live.screen()
    assert re.search(r"^ prefill-0\s+up\s+\d+\s+\d+\s+[\d.]+%", screen, re.MULTILINE) and "planner desired decode 1  prefill 1" in screen


def test_every_panel_and_recording_rule_returns_data_under_load(live: Live, prometheus: Prometheus) -> None:
    before = _requests_total(live.screen())
    stop = threading.Event()
    load = threading.Thread(target=closed_loop, args=(live.url("proxy"), mixed_cases(16, seed=3), "tiny", 4, stop), daemon=True)
    load.start()
    try:
        # Under load: requests, KV bytes and decode steps all counted in the last minute.
        for rule in ("pdkv:proxy_requests:rate1m", "pdkv:connector_bytes:rate1m", "pdkv:decode_itl_seconds:p50_1m",
                     "pdkv:proxy_ttft_seconds:p90_1m"):  # fmt: skip
            wait_for(lambda rule=rule: _value(prometheus.query(rule)) > 0, 60, f"{rule} above 0", interval=0.5)
        # The console's numbers move: a request rate above 0 and more requests than before the load.
        rate = re.compile(r"^requests [1-9][\d.,]*/s", re.MULTILINE)
        wait_for(lambda: rate.search(live.screen()), 10, "a request rate on the console", interval=0.2)
        moved = live.screen()
        top = subprocess.run([sys.executable, "-m", "pdkv", "top", "--proxy", live.url("proxy"), "--once", "--json", "--interval", "2"],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    finally:
        stop.set()
        load.join(timeout=150)
    print("\n".join(["", "--- the console under load:", *moved.rstrip().splitlines()]))
    assert _requests_total(moved) > before
    assert re.search(r"^transfers [1-9][\d.,]*/s", moved, re.MULTILINE), moved
    assert top.returncode == 0, top.stderr
    doc = json.loads(top.stdout)
    assert [(e["name"], e["up"]) for e in doc["engines"]] == [("prefill-0", True), ("decode-0", True)]
    assert doc["serving"]["requests_per_s"] > 0 and doc["serving"]["ttft_p90_ms"] > 0 and doc["serving"]["itl_p50_ms"] > 0
    assert doc["transfers"]["per_s"] > 0 and doc["transfers"]["bytes_per_s"] > 0 and doc["transfers"]["sent"] > 0
    assert doc["planner"] == {"desired": {"decode": 1, "prefill": 1}, "current": {"decode": 1, "prefill": 1}}
    empty = [f"{title}: {expr}" for title, expr in _dashboard_queries() if not prometheus.query(expr)]
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)
    empty = [rule for rule in _recording_rules() if not prometheus.query(rule)]
    assert not empty, f"recording rules without data: {empty}"
    sent = prometheus.query('pdkv_connector_transfers_total{job="pdkv-prefill", outcome="sent"}')
    assert _value(sent) > 0, sent
    assert not prometheus.alerts("PdkvPartDown")


def test_a_killed_p_shows_on_the_console_and_fires_part_down_until_it_is_back(live: Live, prometheus: Prometheus) -> None:
    pid = int(live.row("prefill-0")["pid"])
    t0 = time.monotonic()
    os.killpg(pid, signal.SIGKILL)
    # Within two refreshes the console's row of P says it is no longer ready.
    seen: dict[str, str] = {}

    def gone() -> bool:
        seen.update(live.row("prefill-0"))
        return seen.get("state", "ready") != "ready"

    shown = waited_for(gone, 2 * REFRESH_S + 5, "the console to show P gone", interval=0.05)
    print(f"\nthe console showed prefill-0 {seen['state']!r} {shown:.2f} s after the kill")
    assert shown <= 2 * REFRESH_S + 0.5, f"{shown:.2f} s: more than two refreshes"

    def firing() -> bool:
        return any(a["state"] == "firing" and a["labels"].get("job") == "pdkv-prefill" for a in prometheus.alerts("PdkvPartDown"))

    fired = waited_for(firing, 30, "PdkvPartDown firing for pdkv-prefill", interval=0.5)
    print(f"PdkvPartDown firing {fired + shown:.1f} s after P was killed")
    try:
        back = waited_for(lambda: not prometheus.alerts("PdkvPartDown"), BACK_TIMEOUT_S, "PdkvPartDown to resolve", interval=1.0)
    except AssertionError:
        raise AssertionError(f"P did not come back:\n{live.screen()}\n{live.tails()}") from None
    print(f"PdkvPartDown resolved {back:.1f} s later (P restarted by pdkv up), {time.monotonic() - t0:.1f} s after the kill")
    wait_for(lambda: live.row("prefill-0").get("state") == "ready", 10, "the console to show P ready again", interval=0.2)
    row = live.row("prefill-0")
    assert int(row["pid"]) != pid and row["restarts"] == "1", row
    screen = live.screen()
    assert "prefill-0 killed by SIGKILL" in screen and f"log: {live.logs / 'prefill-0.log'}" in screen  # the event, its log
