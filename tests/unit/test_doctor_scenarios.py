"""Every doctor scenario from a fixture tree under tests/fixtures/sys: the verdict and the hint it gives.

No RDMA NIC or GPU exists on the test machine, so the sysfs/procfs/dev side
comes from the trees, and the GPU list and the CUDA DMA-BUF answer from fakes
named as such.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pdkv.doctor import CHECKS, DmabufProbe, DoctorOptions, GpuInfo, GpuInventory, GpuLookupError, Host, Status, SysRoot, run_doctor
from pdkv.doctor.gpu import check_gpu_nic_numa, check_gpudirect_rdma, check_gpus
from pdkv.doctor.host import check_memlock, check_ports
from pdkv.doctor.rdma import check_rdma_device, check_rdma_devices, check_roce_gid, check_uverbs, read_rdma_devices
from pdkv.doctor.software import check_mooncake

SYS = Path(__file__).parents[1] / "fixtures" / "sys"


def fake_gpu_list(*placements: str) -> callable:
    """A fake NVML: H200s at the given PCI bus ids (NVML's 8-digit-domain spelling)."""
    inventory = GpuInventory(
        gpus=[GpuInfo(index=i, name="NVIDIA H200 (fake)", memory_bytes=141 * 2**30, pci_bus_id=bus) for i, bus in enumerate(placements)],
        driver="570.124.06",
        cuda="12.8",
    )
    return lambda: inventory


def fake_no_nvml() -> GpuInventory:
    raise GpuLookupError("NVML did not start: NVML Shared Library Not Found (fake)", missing=True)


def fake_dmabuf(supported: list[bool] | None) -> callable:
    return lambda: DmabufProbe(supported, f"fake CUDA DMA_BUF_SUPPORTED={supported}")


def host_for(scenario: str, *, env: dict[str, str] | None = None, gpus=fake_no_nvml, dmabuf=fake_dmabuf(None)) -> Host:
    return Host(
        root=SysRoot(SYS / scenario),
        env=env or {},
        gpus=gpus,
        net_addrs=lambda: {"lo": ["127.0.0.1"], "eth0": ["10.0.0.1"]},
        dmabuf=dmabuf,
    )


RDMA = DoctorOptions(transport="rdma", device="mlx5_0", skip_mooncake=True)

# (scenario, check, options, status, words in the detail, words in the hint)
VERDICTS = [
    ("healthy_ndr", check_rdma_device, RDMA, Status.PASS, "mlx5_0/1 ACTIVE LinkUp InfiniBand 400 Gb/s 4X NDR", ""),
    ("no_peermem", check_gpudirect_rdma, RDMA, Status.FAIL, "nvidia_peermem not loaded", "modprobe nvidia_peermem"),
    ("port_down", check_rdma_device, RDMA, Status.FAIL, "mlx5_0 has no ACTIVE port: mlx5_0/1 DOWN Polling",
     "check the cable and the switch port"),
    ("port_down", check_rdma_devices, RDMA, Status.FAIL, "no ACTIVE port", "no link partner"),
    ("device_missing", check_rdma_device, RDMA, Status.FAIL, "mlx5_0 not found; present: mlx5_1 (400 Gb/s ACTIVE)", "use --device mlx5_1"),
    ("mixed_25g_400g", check_rdma_device, RDMA, Status.WARN, "mlx5_0 at 25 Gb/s is slower than mlx5_1 at 400 Gb/s", "use --device mlx5_1"),
    ("mixed_25g_400g", check_roce_gid, RDMA, Status.PASS, "index 3: 10.0.0.17 (RoCE v2, ens1f0np0)", ""),
    ("roce_linklocal", check_roce_gid, RDMA, Status.FAIL, "no usable RoCEv2 GID", "give ens2f0np0 a routable IPv4/IPv6 address"),
    ("memlock_64k", check_memlock, RDMA, Status.FAIL, "soft 64 KiB, hard 64 KiB", "docker --ulimit memlock=-1:-1"),
    ("healthy_ndr", check_memlock, RDMA, Status.PASS, "soft unlimited", ""),
    ("healthy_ndr", check_uverbs, RDMA, Status.PASS, "uverbs0->mlx5_0", ""),
    ("device_missing", check_uverbs, DoctorOptions(device="mlx5_1"), Status.PASS, "uverbs1->mlx5_1", ""),
]


@pytest.mark.parametrize(("scenario", "check", "options", "status", "detail", "hint"), VERDICTS, ids=lambda v: getattr(v, "__name__", None))
def test_scenario_verdict_and_hint(scenario, check, options, status, detail, hint):
    result = check(host_for(scenario), options)
    assert result.name == check.__name__.removeprefix("check_")
    assert result.status is status, result
    assert detail in result.detail
    assert hint in result.hint
    # A failure or warning always says how to fix it.
    assert result.hint or status in (Status.PASS, Status.SKIP)


def test_rates_parsed_from_each_nic():
    devices = {d.name: d for d in read_rdma_devices(SysRoot(SYS / "mixed_25g_400g"))}
    assert devices["mlx5_0"].best_rate == 25.0
    assert devices["mlx5_1"].best_rate == 400.0
    assert devices["mlx5_0"].ports[0].link_layer == "Ethernet"
    assert devices["mlx5_1"].ports[0].state == "ACTIVE" and devices["mlx5_1"].ports[0].phys_state == "LinkUp"


def test_no_device_given_warns_when_active_rates_differ():
    result = check_rdma_device(host_for("mixed_25g_400g"), DoctorOptions())
    assert result.status is Status.WARN
    assert "25, 400 Gb/s" in result.detail and "--device mlx5_1" in result.hint
    assert check_rdma_device(host_for("healthy_ndr"), DoctorOptions()).status is Status.PASS


def test_gpu_and_nic_on_different_numa_nodes_warns():
    # GPU0 sits on node 0, GPU1 on node 1; the only NIC is on node 1.
    host = host_for("numa_mismatch", gpus=fake_gpu_list("00000000:18:00.0", "00000000:9A:00.0"))
    result = check_gpu_nic_numa(host, RDMA)
    assert result.status is Status.WARN
    assert "GPU0 (node 0)" in result.detail and "GPU1" not in result.detail.split(":")[0]
    assert "mlx5_0 node 1" in result.detail
    assert "serve from a GPU on node 1" in result.hint


def test_gpu_and_nic_on_the_same_node_pass():
    host = host_for("healthy_ndr", gpus=fake_gpu_list("00000000:18:00.0"))
    assert check_gpu_nic_numa(host, RDMA).status is Status.PASS
    gpus = check_gpus(host, RDMA)
    assert gpus.status is Status.PASS and "1 GPU(s): GPU0 NVIDIA H200 (fake) 141 GiB 0000:18:00.0" in gpus.detail


def test_gpu_lookup_absent_or_broken_never_raises():
    assert check_gpus(host_for("healthy_ndr"), RDMA).status is Status.SKIP
    assert check_gpu_nic_numa(host_for("healthy_ndr"), RDMA).status is Status.SKIP

    def fake_broken_nvml() -> GpuInventory:
        raise GpuLookupError("NVML query failed: Unknown Error (fake)", missing=False)

    result = check_gpus(host_for("healthy_ndr", gpus=fake_broken_nvml), RDMA)
    assert result.status is Status.WARN and "Unknown Error" in result.detail


def test_no_peermem_but_dmabuf_supported_is_a_warning_naming_the_mooncake_build():
    env_host = host_for("no_peermem", dmabuf=fake_dmabuf([True, True]))
    result = check_gpudirect_rdma(env_host, RDMA)
    assert result.status is Status.WARN
    assert "WITH_NVIDIA_PEERMEM" in result.detail and "kernel 5.15.0-122-generic" in result.detail
    assert "modprobe nvidia_peermem" in result.hint
    refused = check_gpudirect_rdma(host_for("no_peermem", dmabuf=fake_dmabuf([True, False])), RDMA)
    assert refused.status is Status.FAIL and "Bad address" in refused.detail


def test_mc_gid_index_pointing_at_a_link_local_gid_fails():
    host = host_for("mixed_25g_400g", env={"MC_GID_INDEX": "1"})
    result = check_roce_gid(host, RDMA)
    assert result.status is Status.FAIL
    assert "MC_GID_INDEX=1 is link-local" in result.detail and "MC_GID_INDEX=3" in result.hint
    assert check_roce_gid(host_for("mixed_25g_400g", env={"MC_GID_INDEX": "3"}), RDMA).status is Status.PASS


def test_tcp_skips_every_rdma_only_check_with_the_reason():
    tcp = DoctorOptions(transport="tcp", device="mlx5_0")
    for check in (
        check_rdma_devices, check_rdma_device, check_uverbs, check_gpudirect_rdma, check_memlock, check_roce_gid, check_gpu_nic_numa
    ):
        result = check(host_for("port_down"), tcp)
        assert result.status is Status.SKIP and "transport tcp" in result.detail


def test_healthy_host_passes_every_host_check():
    checks = [c for c in CHECKS if c not in (check_ports, check_mooncake)]
    host = host_for("healthy_ndr", gpus=fake_gpu_list("00000000:18:00.0"))
    report = run_doctor(RDMA, host=host, checks=checks)
    assert report.ok, report.failed
    by_name = {c.name: c.status for c in report.checks}
    assert by_name["roce_gid"] is Status.SKIP  # InfiniBand, no RoCE GID needed
    passing = ("rdma_devices", "rdma_device", "uverbs", "gpudirect_rdma", "memlock", "gpus", "gpu_nic_numa")
    assert all(by_name[n] is Status.PASS for n in passing)


def test_report_lists_failures_first_then_warnings():
    checks = [c for c in CHECKS if c not in (check_ports, check_mooncake)]
    host = host_for("mixed_25g_400g", env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PDKV_TOKEN": "k"})
    report = run_doctor(RDMA, host=host, checks=checks)
    statuses = [c.status for c in report.checks]
    assert statuses == sorted(statuses, key=[Status.FAIL, Status.WARN, Status.PASS, Status.SKIP].index)
    assert report.checks[0].name == "alloc_conf" and not report.ok
    assert report.counts["fail"] == 1 and report.counts["warn"] == 1


@pytest.mark.parametrize("transport", ["cma", "socket"])
def test_cma_and_socket_skip_every_rdma_only_check_and_mooncake(transport):
    options = DoctorOptions(transport=transport)
    for check in (
        check_rdma_devices, check_rdma_device, check_uverbs, check_gpudirect_rdma, check_memlock, check_roce_gid, check_gpu_nic_numa,
        check_mooncake,
    ):
        result = check(host_for("port_down"), options)
        assert result.status is Status.SKIP and f"transport {transport}" in result.detail


def test_socket_probe_writes_through_a_real_listener_on_the_advertised_address(tmp_path):
    from pdkv.doctor.socket_probe import check_socket

    def host(ip: str) -> Host:
        return Host(root=SysRoot(tmp_path), env={"VLLM_HOST_IP": ip}, gpus=fake_no_nvml, net_addrs=lambda: {}, dmabuf=fake_dmabuf(None))

    result = check_socket(host("127.0.0.1"), DoctorOptions(transport="socket"))
    assert result.status is Status.PASS and "D's listener on 127.0.0.1 took a 4 MiB write" in result.detail, result.detail
    # An address of no interface here (TEST-NET-3): the listener cannot bind it, and the fix says what to set.
    bad = check_socket(host("203.0.113.7"), DoctorOptions(transport="socket"))
    assert bad.status is Status.FAIL and "203.0.113.7" in bad.detail and "VLLM_HOST_IP" in bad.hint
    assert check_socket(host("127.0.0.1"), DoctorOptions(transport="tcp")).status is Status.SKIP


@pytest.mark.parametrize("scope", ["2", "3"])
def test_cma_fails_where_yama_forbids_writing_into_another_process(tmp_path, scope):
    from pdkv.doctor.cma import check_cma

    yama = tmp_path / "proc/sys/kernel/yama"
    yama.mkdir(parents=True)
    (yama / "ptrace_scope").write_text(scope + "\n")
    host = Host(root=SysRoot(tmp_path), env={}, gpus=fake_no_nvml, net_addrs=lambda: {}, dmabuf=fake_dmabuf(None))
    result = check_cma(host, DoctorOptions(transport="cma"))
    assert result.status is Status.FAIL and f"ptrace_scope is {scope}" in result.detail
    assert "--transport tcp" in result.hint


def test_cma_writes_into_a_real_child_process_and_checks_the_bytes(tmp_path):
    # No Yama in the tree (as on this machine): the live probe decides.
    from pdkv.doctor.cma import check_cma

    host = Host(root=SysRoot(tmp_path), env={}, gpus=fake_no_nvml, net_addrs=lambda: {}, dmabuf=fake_dmabuf(None))
    result = check_cma(host, DoctorOptions(transport="cma"))
    assert result.status is Status.PASS, result.detail
    assert "bytes verified" in result.detail
    assert check_cma(host, DoctorOptions(transport="tcp")).status is Status.SKIP


def test_no_deployment_key_on_a_networked_host_is_a_warning_with_the_fix():
    from pdkv.doctor.network import check_deployment_key

    exposed = check_deployment_key(host_for("healthy_ndr", env={"VLLM_HOST_IP": "10.0.0.2"}), RDMA)
    assert exposed.status is Status.WARN and "PDKV_TOKEN" in exposed.hint and "transfer id" in exposed.detail
    assert check_deployment_key(host_for("healthy_ndr", env={"VLLM_HOST_IP": "10.0.0.2", "PDKV_TOKEN": "k"}), RDMA).status is Status.PASS
    retired = check_deployment_key(host_for("healthy_ndr", env={"VLLM_HOST_IP": "10.0.0.2", "PDKV_BOOTSTRAP_TOKEN": "k"}), RDMA)
    assert retired.status is Status.FAIL and "PDKV_TOKEN is not" in retired.detail and "export PDKV_TOKEN" in retired.hint
    assert check_deployment_key(host_for("healthy_ndr", env={"VLLM_HOST_IP": "127.0.0.1"}), RDMA).status is Status.PASS
