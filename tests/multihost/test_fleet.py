"""One fleet file, three "hosts" (network namespaces on a bridge): bootstrap and proxy on A, P on B, D on C.

Each host runs `pdkv up -f fleet.toml --host NAME` inside its namespace. The
KV crosses the bridge over Mooncake tcp with pdkv's connector: D's greedy
answers equal P alone's for prompts of 1, 17 and 1000 tokens (token ids and
logprobs), the trace's bytes equal `pdkv plan`'s, D's transfer-engine session
is C's address and P's side channel B's. P is pinned to core 0, D to core 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from loadclient import Answer, same_greedy_answer
from netns import NetnsHost

from pdkv.geometry import geometry_from_model, plan_transfer

pytestmark = [pytest.mark.e2e, pytest.mark.multihost]

BLOCK = 32
LENGTHS = [1, 17, 1000]
READY_S = 420.0
HERE = Path(__file__).resolve().parent

FLEET = """\
model = "{model}"
served_model_name = "tiny"
connector = "pdkv"
protocol = "tcp"
platform = "cpu"
block_size = {block}
max_model_len = 2048
restart = "no"
{hosts}
[bootstrap]
host = "A"
port = 8998

[[prefill]]
host = "B"
port = 8100
omp_bind = "0"

[[decode]]
host = "C"
port = 8200
omp_bind = "1"

[proxy]
host = "A"
port = 8000
"""


@dataclass
class Fleet:
    file: Path
    model: Path
    hosts: dict[str, NetnsHost]
    logs: Path
    ready_s: float


def _read_events(proc: subprocess.Popen, events: list[dict]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            events.append(json.loads(line))
        except ValueError:
            pass


@pytest.fixture(scope="module")
def fleet(testbed, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    hosts = {h.name: h for h in testbed(["A", "B", "C"])}
    root = tmp_path_factory.mktemp("fleet")
    tables = "".join(f'\n[[hosts]]\nname = "{h.name}"\naddress = "{h.address}"\n' for h in hosts.values())
    file = root / "fleet.toml"
    file.write_text(FLEET.format(model=tiny_model, block=BLOCK, hosts=tables))
    procs: dict[str, subprocess.Popen] = {}
    events: dict[str, list[dict]] = {}
    stderr: list = []
    readers: list[threading.Thread] = []
    t0 = time.monotonic()
    try:
        for name, h in hosts.items():
            stderr.append(log := (root / f"{name}.stderr").open("w"))
            cmd = h.argv(sys.executable, "-m", "pdkv", "up", "-f", str(file), "--host", name, "--json", "--log-dir", str(root / name))
            procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
            events[name] = []
            readers.append(threading.Thread(target=_read_events, args=(procs[name], events[name]), daemon=True))
            readers[-1].start()
        while not all(any(e.get("event") == "ready" for e in events[n]) for n in hosts):
            for name, proc in procs.items():
                if proc.poll() is not None:
                    tail = (root / f"{name}.stderr").read_text()[-3000:]
                    raise AssertionError(f"pdkv up on {name} exited with {proc.returncode}: {tail}")
            if time.monotonic() - t0 > READY_S:
                raise AssertionError(f"the fleet was not ready within {READY_S:g} s: {events}")
            time.sleep(0.5)
        yield Fleet(file, tiny_model, hosts, root, time.monotonic() - t0)
    except BaseException:
        for log in sorted(root.glob("*/*.log")) + sorted(root.glob("*.stderr")):
            print(f"--- {log.relative_to(root)} ---\n{log.read_text()[-3000:]}")
        raise
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(2)  # SIGINT: pdkv up stops its parts, proxy first
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()  # the test bed stops whatever is left in the namespaces
                proc.wait(10)
        for reader in readers:
            reader.join(10)  # at the exited process's end of output
        for proc in procs.values():
            if proc.stdout is not None:
                proc.stdout.close()
        for f in stderr:
            f.close()


@pytest.fixture(scope="module")
def measured(fleet: Fleet) -> dict:
    a, b = fleet.hosts["A"], fleet.hosts["B"]
    cmd = a.argv(sys.executable, str(HERE / "fleet_client.py"), f"http://{a.address}:8000", f"http://{b.address}:8100",
                 str(fleet.file), str(fleet.model), *map(str, LENGTHS))
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_each_host_starts_only_its_parts(fleet: Fleet) -> None:
    ready = {}
    for name in fleet.hosts:
        ready[name] = sorted(p.name for p in (fleet.logs / name).glob("*.log"))
    assert ready == {"A": ["bootstrap-0.log", "proxy.log"], "B": ["prefill-0.log"], "C": ["decode-0.log"]}
    print(f"fleet ready in {fleet.ready_s:.1f} s")


@pytest.mark.parametrize("n", LENGTHS)
def test_answer_across_hosts_equals_p_alone(measured: dict, n: int) -> None:
    entry = next(e for e in measured["answers"] if e["n"] == n)
    got, want = Answer(**entry["pd"]), Answer(**entry["alone"])
    assert got.status == 200 and want.status == 200, (got.error, want.error)
    assert len(got.tokens) == len(want.tokens) > 0
    assert same_greedy_answer(got, want) is None, same_greedy_answer(got, want)
    for tok, want_tok, a, b in zip(got.tokens, want.tokens, got.logprobs, want.logprobs, strict=True):
        if tok != want_tok:
            break  # a tie in P alone's answer (same_greedy_answer allows it): the rest may differ
        assert a == pytest.approx(b, abs=2e-2)


def test_kv_crosses_hosts_with_plans_bytes(fleet: Fleet, measured: dict) -> None:
    trace = measured["trace"]
    assert trace["transfer"] is not None and trace["transfer"]["status"] == "sent", trace["notes"]
    plan = plan_transfer(geometry_from_model(str(fleet.model)), prompt_tokens=trace["prompt_tokens"], block_size=BLOCK)
    assert trace["transfer"]["bytes"] == plan.transfer_bytes
    c, b = fleet.hosts["C"].address, fleet.hosts["B"].address
    sessions = {t.get("session", "") for t in trace["connector"]}
    assert sessions and all(s.rsplit(":", 1)[0] == c for s in sessions), sessions  # P wrote into C
    regs = measured["status"]["registrations"]
    assert regs and all(r["addr"].split("://", 1)[-1].rsplit(":", 1)[0] == b for r in regs), regs  # P's side channel is on B
    parts = {p["name"]: p for p in measured["status"]["parts"]}
    assert all(p["up"] for p in parts.values()), parts
    assert parts["decode-0"]["url"] == f"http://{c}:8200"
