"""One fleet file, three "hosts" (network namespaces on a bridge): bootstrap and proxy on A, P on B, D on C.

Each host runs `pdkv up -f fleet.toml --host NAME` inside its namespace. The
KV crosses the bridge over Mooncake tcp with pdkv's connector (PDKV_FLEET_TRANSPORT=socket: over pdkv's own
TCP transport instead): D's greedy
answers equal P alone's for prompts of 1, 17 and 1000 tokens (token ids and
logprobs), the trace's bytes equal `pdkv plan`'s, D's transfer-engine session
is C's address and P's side channel B's. P is pinned to core 0, D to core 1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.loadclient import Answer, same_greedy_answer
from support.waiting import waited_for
from netns import NetnsHost

from pdkv.geometry import geometry_from_model, size_transfer
from pdkv.tinymodel import TINY_KV_CACHE_BYTES

pytestmark = [pytest.mark.e2e, pytest.mark.multihost]

BLOCK = 32
LENGTHS = [1, 17, 1000]
READY_S = 420.0
HERE = Path(__file__).resolve().parent
TRANSPORT = os.environ.get("PDKV_FLEET_TRANSPORT", "tcp")  # across hosts: tcp (Mooncake) or socket (pdkv's own)

FLEET = """\
model = "{model}"
served_model_name = "tiny"
connector = "pdkv"
transport = "{transport}"
platform = "cpu"
block_size = {block}
max_model_len = 2048
cpu_kv_cache_bytes = {kv_bytes}
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
    spare: NetnsHost  # on the bridge, in no part of the file: where an engine joins later


def _read_events(proc: subprocess.Popen, events: list[dict]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            events.append(json.loads(line))
        except ValueError:
            pass


@pytest.fixture(scope="module")
def fleet(testbed, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    *made, spare = testbed(["A", "B", "C", "E"])
    hosts = {h.name: h for h in made}
    root = tmp_path_factory.mktemp("fleet")
    tables = "".join(f'\n[[hosts]]\nname = "{h.name}"\naddress = "{h.address}"\n' for h in hosts.values())
    file = root / "fleet.toml"
    file.write_text(FLEET.format(model=tiny_model, block=BLOCK, hosts=tables, transport=TRANSPORT, kv_bytes=TINY_KV_CACHE_BYTES))
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
        yield Fleet(file, tiny_model, hosts, root, time.monotonic() - t0, spare)
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
    # The client imports pdkv from this checkout, installed or not (a script's own folder is its only path).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(HERE.parents[1]), os.environ.get("PYTHONPATH", "")) if p)}
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300, env=env)
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
    plan = size_transfer(geometry_from_model(str(fleet.model)), prompt_tokens=trace["prompt_tokens"], block_size=BLOCK)
    assert trace["transfer"]["bytes"] == plan.transfer_bytes
    c, b = fleet.hosts["C"].address, fleet.hosts["B"].address
    sessions = {t.get("session", "") for t in trace["connector"]}
    assert sessions and all(_session_host(s) == c for s in sessions), sessions  # P wrote into C
    regs = measured["status"]["registrations"]
    assert regs and all(r["addr"].split("://", 1)[-1].rsplit(":", 1)[0] == b for r in regs), regs  # P's side channel is on B
    parts = {p["name"]: p for p in measured["status"]["parts"]}
    assert all(p["up"] for p in parts.values()), parts
    assert parts["decode-0"]["url"] == f"http://{c}:8200"


def _session_host(session: str) -> str:
    """The host of D's transport address: Mooncake's `host:port`, socket's `socket://host:port/<session id>`."""
    return session.removeprefix("socket://").split("/", 1)[0].rsplit(":", 1)[0]


def _get_json(host: NetnsHost, url: str) -> dict:
    """GET `url` from inside `host`'s namespace (the only place the fleet's addresses are reached from)."""
    code = "import httpx, sys; print(httpx.get(sys.argv[1], timeout=5, trust_env=False).text)"
    done = subprocess.run(host.argv(sys.executable, "-c", code, url), check=False, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def _kv_usage(host: NetnsHost, url: str) -> float:
    code = ("import httpx, sys; t = httpx.get(sys.argv[1] + '/metrics', timeout=5, trust_env=False).text; "
            "print(max(float(l.rsplit(' ', 1)[1]) for l in t.splitlines() if l.startswith('vllm:kv_cache_usage_perc')))")
    done = subprocess.run(host.argv(sys.executable, "-c", code, url), check=False, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr[-2000:]
    return float(done.stdout)


def test_every_engine_joins_the_members_registry_at_its_hosts_address(fleet: Fleet, measured: dict) -> None:
    a, b, c = (fleet.hosts[n].address for n in "ABC")
    records = {m["record"]["role"]: m["record"] for m in _get_json(fleet.hosts["A"], f"http://{a}:8998/pdkv/members")["members"]}
    assert set(records) == {"prefill", "decode"}
    assert records["prefill"]["url"] == f"http://{b}:8100" and records["prefill"]["bootstrap_url"] == f"http://{a}:8998"
    assert records["decode"]["url"] == f"http://{c}:8200"
    for rec in records.values():
        assert (rec["model"], rec["block_size"], rec["transport"], rec.get("tp_size", 1)) == ("tiny", BLOCK, TRANSPORT, 1)
    health = _get_json(fleet.hosts["A"], f"http://{a}:8000/health")
    assert health["status"] == "ok" and health["notes"] == []


def _decodes_up(fleet: Fleet) -> list[str]:
    health = _get_json(fleet.hosts["A"], f"http://{fleet.hosts['A'].address}:8000/health")
    return sorted(b["url"] for b in health["backends"] if b["role"] == "decode" and b["up"])


def _answers(fleet: Fleet, n: int, seed: int) -> dict:
    a, b = fleet.hosts["A"].address, fleet.hosts["B"].address
    cmd = fleet.hosts["A"].argv(sys.executable, str(HERE / "join_client.py"), f"http://{a}:8000", f"http://{b}:8100", str(n), str(seed))
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    for entry in doc["answers"]:
        got, want = Answer(**entry["pd"]), Answer(**entry["alone"])
        assert got.status == 200 and want.status == 200, (got.error, want.error)
        assert same_greedy_answer(got, want) is None, same_greedy_answer(got, want)
    return doc


def test_a_decode_engine_started_later_on_another_host_takes_requests_then_leaves(fleet: Fleet, measured: dict) -> None:
    """1P2D with live membership: D2 joins the running fleet from host E (no proxy restart, no file change)."""
    a, c, e = fleet.hosts["A"].address, fleet.hosts["C"].address, fleet.spare.address
    d1, d2 = f"http://{c}:8200", f"http://{e}:8200"
    cmd = fleet.spare.argv(sys.executable, "-m", "pdkv", "up", "--role", "decode", "--model", str(fleet.model), "--platform", "cpu",
                           "--transport", TRANSPORT, "--block-size", str(BLOCK), "--members", f"http://{a}:8998", "--host-ip", e,
                           "--port", "8200", "--omp-bind", "1", "--restart", "no", "--json", "--log-dir", str(fleet.logs / "E"),
                           "--", "--served-model-name", "tiny", "--max-model-len", "2048")
    events: list[dict] = []
    with (fleet.logs / "E.stderr").open("w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
        reader = threading.Thread(target=_read_events, args=(proc, events), daemon=True)
        reader.start()
        try:
            waited_for(lambda: any(ev.get("event") == "ready" for ev in events) or proc.poll() is not None, READY_S, "D2 ready")
            assert proc.poll() is None, (fleet.logs / "E.stderr").read_text()[-3000:]
            took = waited_for(lambda: _decodes_up(fleet) == sorted([d1, d2]), 15, "the proxy routing to D2")
            print(f"D2 routable {took:.1f} s after it was ready")
            doc = _answers(fleet, 8, seed=1)
            assert set(doc["decode_urls"]) == {d1, d2}, doc["decode_urls"]
        finally:
            proc.send_signal(2)  # SIGINT: D2 stops and leaves the registry
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
            reader.join(10)
            if proc.stdout is not None:
                proc.stdout.close()
    gone = waited_for(lambda: _decodes_up(fleet) == [d1], 10, "D2 to leave the proxy's view")
    print(f"D2 out of the proxy's view {gone:.1f} s after it stopped")
    doc = _answers(fleet, 4, seed=2)
    assert set(doc["decode_urls"]) == {d1}


def test_a_cut_link_ends_the_streams_on_it_within_5_s_and_the_host_comes_back(fleet: Fleet, measured: dict) -> None:
    hosts = fleet.hosts
    a, b, c = (hosts[n].address for n in "ABC")
    proxy, p_url, d_url = f"http://{a}:8000", f"http://{b}:8100", f"http://{c}:8200"
    client = subprocess.Popen(hosts["A"].argv(sys.executable, str(HERE / "fault_client.py"), proxy, "6", "1500"),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert client.stdin is not None and client.stdout is not None
    try:
        line = client.stdout.readline()
        assert json.loads(line)["event"] == "streaming", line + client.stderr.read()[-3000:]
        subprocess.run(["ip", "-n", hosts["C"].netns, "link", "set", "eth0", "down"], check=True, timeout=30)
        try:
            client.stdin.write("cut\n")
            client.stdin.flush()
            ended = json.loads(client.stdout.readline() or "{}")
            assert ended.get("event") == "ended", client.stderr.read()[-3000:]
            results = ended["results"]
            print("after the cut:", [(r["after_cut_s"], r["tokens"], r["error"]) for r in results])
            for r in results:
                assert not r["completed"] and r["after_cut_s"] <= 5.0, r
                assert "decode server became unreachable" in (r["error"] or ""), r
            health = _get_json(hosts["A"], f"{proxy}/health")
            assert health["status"] == "unavailable"
            reason = next(x["reason"] for x in health["backends"] if x["role"] == "decode")
            assert "unreachable" in reason or "/health" in reason, reason
        finally:
            subprocess.run(["ip", "-n", hosts["C"].netns, "link", "set", "eth0", "up"], check=True, timeout=30)
        back = waited_for(lambda: _get_json(hosts["A"], f"{proxy}/health")["status"] == "ok", 30, "the proxy re-admitting D")
        print(f"D re-admitted {back:.1f} s after the link came back")
    finally:
        client.kill()
        client.wait(10)
        for pipe in (client.stdin, client.stdout, client.stderr):
            if pipe is not None:
                pipe.close()
    got = _get_json(hosts["A"], f"{proxy}/health")
    assert got["status"] == "ok"
    code = ("import httpx, sys; r = httpx.post(sys.argv[1] + '/v1/completions', json={'model': 'tiny', 'prompt': 'again', "
            "'max_tokens': 4}, timeout=60, trust_env=False); print(r.status_code)")
    done = subprocess.run(hosts["A"].argv(sys.executable, "-c", code, proxy), capture_output=True, text=True, timeout=90, check=False)
    assert done.stdout.strip() == "200", done.stderr[-2000:]
    # Nothing leaks on either side: D's cut streams end once its sockets learn the proxy is gone; P sent before the cut.
    freed = waited_for(lambda: _kv_usage(hosts["A"], d_url) == 0.0 and _kv_usage(hosts["A"], p_url) == 0.0, 120, "P's and D's KV freed")
    print(f"KV freed on P and D {freed:.1f} s after the proxy was back")
