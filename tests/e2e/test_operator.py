"""What an operator sees of a live CPU 1P1D (`pdkv up -f`, the tiny model, the planner on): a real Prometheus
(Debian's `prometheus`) scrapes it with the shipped scrape configuration and rules; every dashboard panel's
query and every recording rule returns data under a short load, and `pdkv top --once --json` shows the load;
`PdkvPartDown` fires when P is killed and resolves once `pdkv up` has it back.

Two changes to the shipped files, both for time: the scrape and rule intervals are 1 s (5 s shipped), and every
alert's `for` is 2 s (a test cannot wait the shipped 30 s to minutes). Targets are the deployment's free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
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
from support.waiting import wait_for, waited_for

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="needs Debian's prometheus package (scripts/setup.sh)"),
    pytest.mark.skipif(Path("/dev/nvidia0").exists(), reason="a CPU deployment: runs where no GPU is present"),
]

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
READY_TIMEOUT_S = float(os.environ.get("PDKV_E2E_UP_TIMEOUT", "600"))
BACK_TIMEOUT_S = 240.0  # P killed to P scraped again, on 2 cores


@dataclass
class Live:
    proc: subprocess.Popen[str]
    logs: Path
    ports: dict[str, int]
    ready: dict = field(default_factory=dict)
    events: list[dict] = field(default_factory=list)  # guarded by the GIL: appended by the reader thread only
    seen: set[int] = field(default_factory=set)

    def url(self, part: str) -> str:
        return f"http://127.0.0.1:{self.ports[part]}"

    def pid(self, name: str) -> int:
        pids = {p["name"]: p["pid"] for p in self.ready["parts"]}
        for e in self.events:
            if e.get("event") == "restarted":
                pids[e["name"]] = e["pid"]
        return pids[name]

    def tails(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-25:])
                         for p in sorted(self.logs.glob("*.log")))  # fmt: skip


def _read_events(live: Live) -> None:
    assert live.proc.stdout is not None
    for line in live.proc.stdout:
        with contextlib.suppress(json.JSONDecodeError):
            live.events.append(json.loads(line))


@pytest.fixture(scope="module")
def live(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    tmp = tmp_path_factory.mktemp("operator")
    profile = write_profile(tmp / "tiny.profile.json")
    ports = {"bootstrap": free_port(pair=True), "prefill": free_port(), "decode": free_port(), "proxy": free_port()}
    deploy = tmp / "deploy.toml"
    deploy.write_text(f"""
model = "{tiny_model}"
served_model_name = "tiny"
protocol = "cma"
platform = "cpu"
host = "127.0.0.1"
host_ip = "127.0.0.1"
block_size = 32
max_model_len = 2048
kv_events = false
[bootstrap]
port = {ports["bootstrap"]}
[[prefill]]
port = {ports["prefill"]}
omp_bind = "0"
[[decode]]
port = {ports["decode"]}
omp_bind = "1"
[proxy]
port = {ports["proxy"]}
extra_args = ["--health-interval", "1"]
[autoscale]
profile = "{profile}"
ttft_ms = 2000
itl_ms = 10000
interval_s = 1
[autoscale.prefill]
min = 1
max = 1
[autoscale.decode]
min = 1
max = 1
""")
    logs = tmp / "logs"
    t0 = time.monotonic()
    with (tmp / "up.stderr").open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "up", "-f", str(deploy), "--json", "--log-dir", str(logs)],
                                stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)  # fmt: skip
    running = Live(proc, logs, ports)
    reader = threading.Thread(target=_read_events, args=(running,), daemon=True)
    reader.start()
    try:
        def ready() -> bool:
            running.ready = next((e for e in running.events if e.get("event") == "ready"), {})
            assert proc.poll() is None, f"pdkv up ended: {(tmp / 'up.stderr').read_text()[-2000:]}\n{running.tails()}"
            return bool(running.ready)

        waited = waited_for(ready, READY_TIMEOUT_S, "pdkv up to be ready")
        print(f"\npdkv up ready after {waited:.1f} s (module start {time.monotonic() - t0:.1f} s)")
        with contextlib.suppress(psutil.NoSuchProcess):
            running.seen = {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for pid in running.seen:  # a failed test must not leave engines on the shared cores
            with contextlib.suppress(psutil.NoSuchProcess):
                psutil.Process(pid).kill()
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


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


def test_every_panel_and_recording_rule_returns_data_under_load(live: Live, prometheus: Prometheus) -> None:
    stop = threading.Event()
    load = threading.Thread(target=closed_loop, args=(live.url("proxy"), mixed_cases(16, seed=3), "tiny", 4, stop), daemon=True)
    load.start()
    try:
        # Under load: requests, KV bytes and decode steps all counted in the last minute.
        for rule in ("pdkv:proxy_requests:rate1m", "pdkv:connector_bytes:rate1m", "pdkv:decode_itl_seconds:p50_1m",
                     "pdkv:proxy_ttft_seconds:p90_1m"):  # fmt: skip
            wait_for(lambda rule=rule: _value(prometheus.query(rule)) > 0, 60, f"{rule} above 0", interval=0.5)
        top = subprocess.run([sys.executable, "-m", "pdkv", "top", "--proxy", live.url("proxy"), "--once", "--json", "--interval", "2"],
                             capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        stop.set()
        load.join(timeout=150)
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
    assert _value(prometheus.query('sum(pdkv_planner_desired_engines)')) == 2
    assert not prometheus.alerts("PdkvPartDown")


def test_killing_p_fires_part_down_and_it_resolves_once_p_is_back(live: Live, prometheus: Prometheus) -> None:
    t0 = time.monotonic()
    os.killpg(live.pid("prefill-0"), signal.SIGKILL)

    def firing() -> bool:
        return any(a["state"] == "firing" and a["labels"].get("job") == "pdkv-prefill" for a in prometheus.alerts("PdkvPartDown"))

    fired = waited_for(firing, 30, "PdkvPartDown firing for pdkv-prefill", interval=0.5)
    print(f"\nPdkvPartDown firing {fired:.1f} s after P was killed")
    try:
        back = waited_for(lambda: not prometheus.alerts("PdkvPartDown"), BACK_TIMEOUT_S, "PdkvPartDown to resolve", interval=1.0)
    except AssertionError:
        raise AssertionError(f"P did not come back: {[e for e in live.events if e.get('name') == 'prefill-0']}\n{live.tails()}") from None
    print(f"PdkvPartDown resolved {back:.1f} s later (P restarted by pdkv up), {time.monotonic() - t0:.1f} s after the kill")
    assert any(e.get("event") == "restarted" and e.get("name") == "prefill-0" for e in live.events)
