"""`pdkv up -f fleet.toml --host NAME` and `pdkv status -f fleet.toml`: the parts of one host, bad input exits 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdkv.cli import run
from support.ports import free_port


def write_fleet(
    tmp_path: Path, hosts: list[tuple[str, str]], *, p_host: str = "B", extra: str = "", ports: tuple[int, ...] = (8998, 8100, 8200, 8000)
) -> Path:
    tables = "".join(f'[[hosts]]\nname = "{n}"\naddress = "{a}"\n' for n, a in hosts)
    boot, pp, dp, xp = ports
    text = f"""model = "/models/m"
platform = "cpu"
transport = "tcp"
block_size = 32
{extra}
{tables}
[bootstrap]
host = "A"
port = {boot}
[[prefill]]
host = "{p_host}"
port = {pp}
omp_bind = "0"
[[decode]]
host = "C"
port = {dp}
omp_bind = "1"
[proxy]
host = "A"
port = {xp}
"""
    path = tmp_path / "fleet.toml"
    path.write_text(text)
    return path


HOSTS = [("A", "10.0.0.1"), ("B", "10.0.0.2"), ("C", "10.0.0.3")]


def dry_run(capsys, *args: str) -> list[dict]:
    code = run(["up", "--dry-run", "--json", *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)["parts"]


def test_host_b_starts_only_its_prefill_advertising_bs_address(capsys, tmp_path: Path) -> None:
    (part,) = dry_run(capsys, "-f", str(write_fleet(tmp_path, HOSTS)), "--host", "B")
    assert part["name"] == "prefill-0" and part["url"] == "http://10.0.0.2:8100"
    assert part["env"]["VLLM_HOST_IP"] == "10.0.0.2"
    config = json.loads(part["argv"][part["argv"].index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["bootstrap_server_address"] == "10.0.0.1:8998"


def test_host_a_starts_bootstrap_and_proxy_pointing_at_the_other_hosts(capsys, tmp_path: Path) -> None:
    boot, proxy = dry_run(capsys, "-f", str(write_fleet(tmp_path, HOSTS)), "--host", "A")
    assert (boot["name"], proxy["name"]) == ("bootstrap-0", "proxy")
    argv = proxy["argv"]
    assert argv[argv.index("--prefill") + 1] == "http://10.0.0.2:8100,http://10.0.0.1:8998"
    assert argv[argv.index("--decode") + 1] == "http://10.0.0.3:8200"


def test_without_host_the_parts_of_this_machines_addresses(capsys, tmp_path: Path) -> None:
    # 127.0.0.1 is an address of every machine; 10.0.0.x are (here) not.
    parts = dry_run(capsys, "-f", str(write_fleet(tmp_path, [("A", "10.0.0.1"), ("B", "127.0.0.1"), ("C", "10.0.0.3")])))
    assert [p["name"] for p in parts] == ["prefill-0"]


@pytest.mark.parametrize(
    ("hosts", "args", "p_host", "match"),
    [
        (HOSTS, ["--host", "Z"], "B", "--host Z: no such host in the deployment file (hosts: A, B, C)"),
        (HOSTS, [], "B", "no host of the deployment file has an address of this machine"),
        (HOSTS, ["--host", "B"], "Q", "[[prefill]] 1 names host 'Q', which is not among the [[hosts]]"),
        ([("A", "10.0.0.1"), ("B", "10.0.0.1"), ("C", "10.0.0.3")], ["--host", "A"], "B", "hosts 'A' and 'B' have one address, 10.0.0.1"),
        ([("A", "10.0.0.1"), ("B", "10.0.0"), ("C", "10.0.0.3")], ["--host", "A"], "B", "not an IPv4 or IPv6 address"),
    ],
)
def test_bad_fleet_input_is_one_line_and_exit_2(capsys, tmp_path: Path, hosts, args: list[str], p_host: str, match: str) -> None:
    assert run(["up", "-f", str(write_fleet(tmp_path, hosts, p_host=p_host)), *args, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert match in err
    assert err.startswith("pdkv: error: ") and len([line for line in err.splitlines() if line.startswith("pdkv: error")]) == 1


def test_host_alone_is_a_usage_error(capsys) -> None:
    assert run(["up", "--host", "A", "--dry-run"]) == 2
    assert "--host goes with -f FILE" in capsys.readouterr().err


def test_host_with_role_is_a_usage_error_naming_listen(capsys) -> None:
    assert run(["up", "--role", "decode", "--model", "/models/m", "--platform", "cpu", "--host", "127.0.0.1", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--host goes with -f FILE" in err and "is --listen" in err


def test_status_shows_every_hosts_parts(capsys, tmp_path: Path) -> None:
    # Loopback addresses as hosts: nothing listens on these free ports, so every part is down.
    ports = tuple(free_port() for _ in range(4))
    path = write_fleet(tmp_path, [("A", "127.0.0.1"), ("B", "127.0.0.2"), ("C", "127.0.0.3")], ports=ports)
    assert run(["status", "-f", str(path), "--json", "--timeout", "0.5"]) == 1
    doc = json.loads(capsys.readouterr().out)
    got = {p["name"]: (p["host"], p["url"], p["up"]) for p in doc["parts"]}
    assert got == {
        "bootstrap-0": ("A", f"http://127.0.0.1:{ports[0]}", False),
        "prefill-0": ("B", f"http://127.0.0.2:{ports[1]}", False),
        "decode-0": ("C", f"http://127.0.0.3:{ports[2]}", False),
        "proxy": ("A", f"http://127.0.0.1:{ports[3]}", False),
    }
    assert run(["status", "-f", str(path), "--timeout", "0.5"]) == 1
    table = capsys.readouterr().out
    assert "host" in table and "│ B " in table and "│ C " in table
