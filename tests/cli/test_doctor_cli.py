"""`pdkv doctor` end to end through the CLI, on this machine and on fixture roots (PDKV_SYS_ROOT)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from pdkv.cli import run
from support import ports

SYS = Path(__file__).parents[1] / "fixtures" / "sys"


@pytest.fixture(autouse=True)
def plain_env(monkeypatch):
    for var in ("PDKV_SYS_ROOT", "VLLM_HOST_IP", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "MC_FORCE_TCP", "MC_GID_INDEX"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("COLUMNS", "200")


@pytest.fixture(name="free_port")
def _free_port() -> int:
    return ports.free_port()


def checks_of(out: str) -> dict[str, dict]:
    data = json.loads(out)
    assert set(data) >= {"ok", "transport", "device", "sys_root", "elapsed_s", "counts", "checks"}
    for check in data["checks"]:
        assert set(check) == {"name", "status", "detail", "hint"}
    return {c["name"]: c for c in data["checks"]}


def test_tcp_on_this_machine_passes_and_skips_rdma_checks(capsys, free_port):
    code = run(["doctor", "--transport", "tcp", "--skip-mooncake", "--port", str(free_port), "--json"])
    checks = checks_of(capsys.readouterr().out)
    assert code == 0
    for name in ("rdma_devices", "rdma_device", "uverbs", "gpudirect_rdma", "memlock", "roce_gid", "gpu_nic_numa"):
        assert checks[name]["status"] == "skip" and "transport tcp" in checks[name]["detail"]
    assert checks["mooncake"]["status"] == "skip"
    assert checks["vllm"]["status"] == "pass" and "0.32" in checks["vllm"]["detail"]
    assert checks["ports"]["detail"] == f"free: {free_port}"


def test_real_mooncake_tcp_engine_starts(capsys, free_port):
    code = run(["doctor", "--transport", "tcp", "--port", str(free_port), "--json"])
    checks = checks_of(capsys.readouterr().out)
    assert code == 0
    assert checks["mooncake"]["status"] == "pass" and "'tcp'" in checks["mooncake"]["detail"]


def test_rdma_on_this_machine_fails_with_fixes(capsys, free_port):
    # No RDMA NIC here: Mooncake starts, but silently on TCP; the doctor says so.
    code = run(["doctor", "--device", "mlx5_0", "--port", str(free_port)])
    out, err = capsys.readouterr()
    assert code == 4
    assert "FAIL" in out and "no RDMA devices under /sys/class/infiniband" in out
    assert "fell back to TCP" in out
    assert out.index("FAIL") < out.index(" ok ")  # failures first
    assert err.startswith("pdkv: error: ") and "rdma_devices" in err and "hint:" in err


def test_port_down_fixture_exits_4_with_the_hint(capsys, monkeypatch, free_port):
    monkeypatch.setenv("PDKV_SYS_ROOT", str(SYS / "port_down"))
    code = run(["doctor", "--device", "mlx5_0", "--skip-mooncake", "--port", str(free_port), "--json"])
    checks = checks_of(capsys.readouterr().out)
    assert code == 4
    assert checks["rdma_device"]["status"] == "fail"
    assert "check the cable and the switch port" in checks["rdma_device"]["hint"]


def test_healthy_fixture_exits_0(capsys, monkeypatch, free_port):
    monkeypatch.setenv("PDKV_SYS_ROOT", str(SYS / "healthy_ndr"))
    code = run(["doctor", "--device", "mlx5_0", "--skip-mooncake", "--port", str(free_port)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "root " + str(SYS / "healthy_ndr") in out.replace("\n", "")
    assert "400 Gb/s 4X NDR" in out


def test_busy_port_fails(capsys, free_port):
    with socket.socket() as server:
        server.bind(("127.0.0.1", free_port))
        server.listen(1)
        code = run(["doctor", "--transport", "tcp", "--skip-mooncake", "--port", str(free_port), "--json"])
    checks = checks_of(capsys.readouterr().out)
    assert code == 4
    assert checks["ports"]["status"] == "fail" and str(free_port) in checks["ports"]["detail"]
    assert "ss -ltnp" in checks["ports"]["hint"]


def test_bad_port_is_a_usage_error(capsys):
    assert run(["doctor", "--port", "70000"]) == 2
    assert "--port must be 1-65535" in capsys.readouterr().err


def test_help_has_examples(capsys):
    assert run(["doctor", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Examples" in out and "pdkv doctor --device mlx5_0" in out
