"""Every port a deployment file can ever have bound comes from one allocator (pdkv.deploy.plan.ports) and is distinct on
its host: a property over many generated files (one host and fleets, bootstrap modes, KV events on and off, own
events ports, TP and DP, `[autoscale]` bounds), each checked against what every part's command line binds. Pure."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from pdkv.deploy import deployment_parts
from pdkv.deploy.plan.loader import deployment_from_dict
from pdkv.deploy.plan.ports import allocate_ports, distinct_per_host, engine_slots
from pdkv.deploy.plan.added_engines import added_entry, added_slot_parts
from pdkv.deploy.plan.topology import Part

CASES = 400
HOSTS = [{"name": "a", "address": "10.0.0.1"}, {"name": "b", "address": "10.0.0.2"}]
# Written ports are drawn from a window that holds the KV events' default start (5557), so derived ports must step
# around written ones.
WINDOW = range(5540, 5600)


class Written:
    """Ports written in one generated file, distinct on each host (what a valid file writes)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.taken: dict[str | None, set[int]] = {}

    def draw(self, host: str | None, count: int = 1) -> int:
        taken = self.taken.setdefault(host, set())
        while True:
            start = self.rng.choice(WINDOW)
            span = set(range(start, start + count))
            if not span & taken:
                taken |= span
                return start


def random_file(rng: random.Random) -> dict[str, Any]:
    fleet = rng.random() < 0.3
    written = Written(rng)
    place = (lambda: rng.choice(HOSTS)["name"]) if fleet else (lambda: None)
    mode = rng.choice(["standalone", "standalone", "in-worker", "external"])
    kv_events = rng.random() < 0.75

    def table(role: str) -> dict[str, Any]:
        host = place()
        t: dict[str, Any] = {"port": written.draw(host)}
        dp = rng.choice([1, 1, 2])
        if dp > 1:
            t["extra_args"] = ["--data-parallel-size", str(dp)]
        if rng.random() < 0.3:
            t["tp"] = 2
        if kv_events and rng.random() < 0.2:
            t["kv_events_port"] = written.draw(host, 2 * dp)
        if role == "prefill" and mode != "external" and rng.random() < 0.1:
            t["bootstrap_url"] = "http://10.0.0.9:7000"
        return {**t, **({"host": host} if host else {})}

    prefill = [table("prefill") for _ in range(rng.randint(1, 3))]
    decode = [table("decode") for _ in range(rng.randint(1, 3))]
    boot_host = place() if mode == "standalone" else None
    bootstrap: dict[str, Any] = {"mode": mode}
    if mode == "external":
        bootstrap["url"] = "http://10.0.0.9:7000"
    elif mode == "standalone":
        bootstrap["port"] = written.draw(boot_host)
        bootstrap |= {"host": boot_host} if boot_host else {}
    else:  # in-worker: the first prefill runs it on its host
        bootstrap["port"] = written.draw(prefill[0].get("host"))
    proxy_host = place()
    data: dict[str, Any] = {
        "model": "/m", "platform": "cpu", "transport": "tcp", "host": "0.0.0.0", "host_ip": "127.0.0.1",
        "connector": rng.choice(["pdkv", "pdkv", "mooncake"]), "kv_events": kv_events, "bootstrap": bootstrap,
        "prefill": prefill, "decode": decode, "proxy": {"port": written.draw(proxy_host), **({"host": proxy_host} if proxy_host else {})},
    }
    if fleet:
        data["hosts"] = HOSTS
    if data["connector"] == "pdkv" and rng.random() < 0.6:
        data["autoscale"] = {"profile": "p.json", "ttft_ms": 300, "itl_ms": 40,
                             "prefill": {"min": 1, "max": len(prefill) + rng.randint(0, 3)},
                             "decode": {"min": 1, "max": len(decode) + rng.randint(0, 2)}}
    return data


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def bound_ports(part: Part) -> set[int]:
    """The ports `part`'s command line and environment make it bind, read back from them."""
    argv, env = part.launch.argv, part.launch.env
    ports = {int(flag(argv, "--port"))}
    if part.spec is None:
        return ports
    if "VLLM_MOONCAKE_BOOTSTRAP_PORT" in env:
        ports.add(int(env["VLLM_MOONCAKE_BOOTSTRAP_PORT"]))
    dp, tp = part.spec.dp_size, part.spec.tp
    if "--kv-events-config" in argv:
        events = json.loads(flag(argv, "--kv-events-config"))
        pub, replay = (int(events[k].rsplit(":", 1)[1]) for k in ("endpoint", "replay_endpoint"))
        ports |= {pub + r for r in range(dp)} | {replay + r for r in range(dp)}
    if "--kv-transfer-config" in argv:
        side = json.loads(flag(argv, "--kv-transfer-config"))["kv_connector_extra_config"].get("side_channel_port")
        if side:
            ports |= set(range(side, side + dp * tp))
    return ports


def every_part(dep) -> list[Part]:
    """The listed parts and the parts of every engine `[autoscale]` may add."""
    ports = allocate_ports(dep)
    parts = deployment_parts(dep)
    for slot in (s for s in engine_slots(dep) if s.added):
        parts += added_slot_parts(dep, ports, slot.role, slot.index, added_entry(dep, slot.role, slot.index - 1, {}))
    return parts


@pytest.mark.parametrize("seed", range(4))
def test_every_port_of_every_part_ever_started_comes_from_the_allocator_and_is_distinct_on_its_host(seed: int):
    rng = random.Random(seed)
    for case in range(CASES // 4):
        data = random_file(rng)
        dep = deployment_from_dict(data)
        plan = allocate_ports(dep)
        where = f"seed {seed} case {case}: {json.dumps(data)}"
        assert list(distinct_per_host(plan.uses)) == [], where
        parts = every_part(dep)
        for part in parts:
            uses = part.ports
            assert {u.port for u in uses} == bound_ports(part), (part.launch.name, where)
            assert all(u.part == part.launch.name and u.host == part.host and u.setting and 0 < u.port < 65536 for u in uses), where
        # Every port the allocator gives is bound by exactly the part it names: none is planned and never bound.
        assert sorted((u.part, u.port) for p in parts for u in p.ports) == sorted((u.part, u.port) for u in plan.uses), where
        # The ports written in the file stay as written.
        by_name = {p.launch.name: p for p in parts}
        for role in ("prefill", "decode"):
            for i, t in enumerate(data[role]):
                engine = by_name[f"{role}-{i}"]
                assert int(flag(engine.launch.argv, "--port")) == t["port"], where
                if dep.kv_events and "kv_events_port" in t:
                    assert engine.spec.kv_events_port == t["kv_events_port"], where
        assert int(flag(by_name["proxy"].launch.argv, "--port")) == data["proxy"]["port"]
        first = next((u for u in plan.uses if u.what == "bootstrap"), None)
        assert first is None or first.port == data["bootstrap"]["port"], where
        # The proxy follows each engine's KV events where that engine publishes them.
        proxy = by_name["proxy"].launch.argv
        for i, arg in enumerate(proxy):
            if arg == "--kv-events":
                url, endpoints = proxy[i + 1].split("=", 1)
                engine = next(p for p in parts if p.launch.url == url)
                assert int(endpoints.split(",")[0].rsplit(":", 1)[1]) == engine.spec.kv_events_port, where
        # On one host every engine [autoscale] may add has its ports reserved; a fleet adds none here.
        added = {s.name for s in engine_slots(dep) if s.added}
        if dep.autoscale is not None and not dep.hosts:
            assert len(added) == dep.autoscale.prefill.max - len(dep.prefill) + dep.autoscale.decode.max - len(dep.decode), where
            assert {u.part for u in plan.reserved()} >= added, where
        else:
            assert not added and not plan.reserved(), where


def test_the_added_prefills_kv_events_never_take_the_port_of_the_added_bootstrap():
    """The shape of examples/autoscale.toml on one host: bootstrap 8998, KV events at their default, P 1..2."""
    dep = deployment_from_dict({
        "model": "/m", "platform": "cpu", "transport": "cma", "host": "127.0.0.1", "host_ip": "127.0.0.1", "bootstrap": {"port": 8998},
        "prefill": [{"port": 8100}], "decode": [{"port": 8200}], "proxy": {"port": 8000},
        "autoscale": {"profile": "p.json", "ttft_ms": 300, "itl_ms": 40, "prefill": {"min": 1, "max": 2}},
    })
    plan = allocate_ports(dep)
    assert [(u.what, u.port) for u in plan.of("bootstrap-1")] == [("bootstrap", 8999)]
    assert [(u.what, u.port) for u in plan.of("prefill-1")] == [
        ("HTTP", 8101), ("KV events publisher", 5561), ("KV events replay", 5562), ("side channel", 5564)]
    assert sorted(u.port for u in plan.reserved()) == [5561, 5562, 5564, 8101, 8999]
    assert {u.setting for u in plan.of("prefill-1")} == {
        "[autoscale.prefill] max (the next free port after the [[prefill]] ports)", "kv_events_port",
        "kv_events_port (the ports after the KV events)"}


def test_a_port_written_twice_is_left_as_written_and_named_with_both_settings():
    dep = deployment_from_dict({"model": "/m", "host_ip": "127.0.0.1", "bootstrap": {"port": 8100},
                                "prefill": [{"port": 8100}], "decode": [{"port": 8200, "kv_events_port": 5557}]})
    (again, first), = distinct_per_host([u for p in deployment_parts(dep) for u in p.ports])
    assert (again.part, again.setting, first.part, first.setting) == ("prefill-0", "[[prefill]] 1 port", "bootstrap-0", "[bootstrap] port")
    bind, port = again
    assert (bind, port) == ("0.0.0.0", 8100)
    # the decode's own events port is kept; prefill-0's derived ones step past it
    plan = allocate_ports(dep)
    assert [u.port for u in plan.of("decode-0") if u.what.startswith("KV")] == [5557, 5558]
    assert [u.port for u in plan.of("prefill-0") if u.what.startswith("KV")] == [5559, 5560]
