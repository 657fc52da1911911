"""Fleet files ([[hosts]], host = NAME on every part) and which parts one `pdkv up` starts: pure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdkv.deploy import deployment_parts, load_deployment
from pdkv.deploy.plan.fleet import chosen_hosts
from pdkv.deploy.plan.startup import select_parts
from pdkv.deploy.plan.loader import deployment_from_dict
from pdkv.errors import ConfigError, UsageError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet.toml"
HOSTS = [{"name": "A", "address": "10.0.0.1"}, {"name": "B", "address": "10.0.0.2"}, {"name": "C", "address": "fd00::3"}]


def fleet(**over) -> dict:
    data = {
        "model": "m", "platform": "cpu", "transport": "tcp", "hosts": HOSTS,
        "bootstrap": {"host": "A"}, "proxy": {"host": "A", "port": 8000},
        "prefill": [{"host": "B", "port": 8100}], "decode": [{"host": "C", "port": 8200}],
    }
    return {**data, **over}


def kv_config(part) -> dict:
    argv = part.launch.argv
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_each_part_is_reached_at_and_advertises_its_hosts_address() -> None:
    parts = {p.launch.name: p for p in deployment_parts(deployment_from_dict(fleet()))}
    boot, p, d, proxy = parts["bootstrap-0"], parts["prefill-0"], parts["decode-0"], parts["proxy"]
    assert [x.host for x in (boot, p, d, proxy)] == ["A", "B", "C", "A"]
    assert boot.launch.url == "http://10.0.0.1:8998" and proxy.launch.url == "http://10.0.0.1:8000"
    assert p.launch.url == "http://10.0.0.2:8100" and d.launch.url == "http://[fd00::3]:8200"
    assert p.launch.env["VLLM_HOST_IP"] == "10.0.0.2" and d.launch.env["VLLM_HOST_IP"] == "fd00::3"
    assert kv_config(p)["kv_connector_extra_config"]["bootstrap_server_address"] == "10.0.0.1:8998"
    assert p.bootstrap_url == "http://10.0.0.1:8998"
    argv = proxy.launch.argv
    assert argv[argv.index("--prefill") + 1] == "http://10.0.0.2:8100,http://10.0.0.1:8998"
    assert argv[argv.index("--decode") + 1] == "http://[fd00::3]:8200"
    # The deployment-wide listen address keeps its meaning.
    assert p.launch.argv[p.launch.argv.index("--host") + 1] == "0.0.0.0"
    assert boot.launch.argv[boot.launch.argv.index("--host") + 1] == "0.0.0.0"


def test_in_worker_bootstrap_is_on_ps_host() -> None:
    dep = deployment_from_dict(fleet(bootstrap={"mode": "in-worker", "port": 8998}))
    p = next(x for x in deployment_parts(dep) if x.kind == "prefill")
    assert p.bootstrap_url == "http://10.0.0.2:8998" and p.launch.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] == "8998"


def test_single_host_file_is_unchanged() -> None:
    data = fleet()
    del data["hosts"]
    for key in ("bootstrap", "proxy"):
        data[key] = {k: v for k, v in data[key].items() if k != "host"}
    data["prefill"], data["decode"] = [{"port": 8100}], [{"port": 8200}]
    dep = deployment_from_dict({**data, "host": "127.0.0.1", "host_ip": "127.0.0.1"})
    parts = deployment_parts(dep)
    assert {p.host for p in parts} == {None}
    assert [p.launch.url for p in parts] == ["http://127.0.0.1:8998", "http://127.0.0.1:8100", "http://127.0.0.1:8200", "http://127.0.0.1:8000"]
    assert chosen_hosts(dep, None, ["10.9.9.9"]) is None
    assert select_parts(parts, None) == parts


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"prefill": [{"host": "Z", "port": 8100}]}, r"\[\[prefill\]\] 1 names host 'Z', which is not among the \[\[hosts\]\] \(A, B, C\)"),
        ({"decode": [{"port": 8200}]}, r"\[\[decode\]\] 1 names no host, and the file has \[\[hosts\]\]"),
        ({"proxy": {"port": 8000}}, r"\[proxy\] names no host"),
        ({"bootstrap": {"port": 8998}}, r"\[bootstrap\] names no host"),
        ({"hosts": [*HOSTS[:2], {"name": "C", "address": "10.0.0.1"}]}, "hosts 'A' and 'C' have one address, 10.0.0.1"),
        ({"hosts": [*HOSTS[:2], {"name": "C", "address": "fd00:0::1"}, {"name": "D", "address": "fd00::1"}]},
         "hosts 'C' and 'D' have one address"),
        ({"hosts": [*HOSTS, {"name": "A", "address": "10.0.0.9"}]}, "two \\[\\[hosts\\]\\] are named 'A'"),
        ({"hosts": [*HOSTS[:2], {"name": "C", "address": "host-c.example"}]}, "not an IPv4 or IPv6 address"),
        ({"hosts": [*HOSTS[:2], {"name": "C", "address": "10.0.0.300"}]}, "not an IPv4 or IPv6 address"),
        ({"hosts": [*HOSTS[:2], {"name": "C", "address": "0.0.0.0"}]}, "which no peer can reach"),
        ({"hosts": [{"name": "A"}]}, "missing required field `address`"),
        ({"transport": "cma"}, "transport cma moves KV inside one host, and the engines are on 2"),
    ],
)
def test_bad_fleet_files_are_one_line_config_errors(over: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as err:
        deployment_from_dict(fleet(**over))
    assert "\n" not in str(err.value) and err.value.exit_code == 2


def test_a_host_key_without_hosts_is_an_error() -> None:
    data = fleet()
    del data["hosts"]
    with pytest.raises(ConfigError, match=r"\[bootstrap\] names host 'A', and the file has no \[\[hosts\]\]"):
        deployment_from_dict(data)


def test_cma_is_fine_when_the_engines_share_a_host() -> None:
    deployment_from_dict(fleet(transport="cma", decode=[{"host": "B", "port": 8200}]))


def test_host_selection_by_name_and_by_this_machines_addresses() -> None:
    dep = deployment_from_dict(fleet())
    parts = deployment_parts(dep)
    assert chosen_hosts(dep, "B", []) == {"B"}
    assert chosen_hosts(dep, None, ["127.0.0.1", "10.0.0.1", "fe80::1%eth0"]) == {"A"}
    assert chosen_hosts(dep, None, ["10.0.0.2", "fd00:0:0::3"]) == {"B", "C"}
    assert [p.launch.name for p in select_parts(parts, {"A"})] == ["bootstrap-0", "proxy"]
    assert [p.launch.name for p in select_parts(parts, {"B", "C"})] == ["prefill-0", "decode-0"]
    with pytest.raises(UsageError, match=r"--host Z: no such host in the deployment file \(hosts: A, B, C\)"):
        chosen_hosts(dep, "Z", [])
    with pytest.raises(UsageError, match="no host of the deployment file has an address of this machine"):
        chosen_hosts(dep, None, ["127.0.0.1", "192.0.2.7"])


def test_a_prefill_away_from_its_bootstrap_does_not_restart_with_it() -> None:
    # vLLM's connector registers once, so its prefill restarts with its bootstrap where both are on one host.
    parts = deployment_parts(deployment_from_dict(fleet(connector="mooncake")))
    assert next(p for p in parts if p.kind == "prefill").registers_with == "bootstrap-0"
    (p,) = select_parts(parts, {"B"})
    assert p.registers_with is None
    together = deployment_parts(deployment_from_dict(fleet(connector="mooncake", prefill=[{"host": "A", "port": 8100}])))
    assert [p.registers_with for p in select_parts(together, {"A"}) if p.kind == "prefill"] == ["bootstrap-0"]


def test_a_host_with_no_parts_is_a_usage_error() -> None:
    parts = deployment_parts(deployment_from_dict(fleet(hosts=[*HOSTS, {"name": "D", "address": "10.0.0.4"}])))
    with pytest.raises(UsageError, match="host D runs no part"):
        select_parts(parts, {"D"})


def test_example_fleet_file_loads() -> None:
    dep = load_deployment(EXAMPLE)
    assert [h.name for h in dep.hosts] == ["A", "B", "C"]
    assert {p.launch.name: p.host for p in deployment_parts(dep)} == {"bootstrap-0": "A", "prefill-0": "B", "decode-0": "C", "proxy": "A"}
