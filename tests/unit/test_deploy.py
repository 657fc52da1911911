"""Deployment topology, launch plans and the pure pre-flight checks (engine agreement)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest

from pdkv.deploy import deployment_parts, load_deployment, local_deployment
from pdkv.deploy.run.preflight import check_cma, check_connector, check_engines, raise_problems, shared_cores
from pdkv.metrics import read_samples
from pdkv.deploy.plan.loader import deployment_from_dict
from pdkv.errors import ConfigError, PreflightError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "deploy.toml"


def kv_config(part) -> dict:
    argv = part.launch.argv
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


def test_example_file_loads_and_plans_in_start_order() -> None:
    dep = load_deployment(EXAMPLE)
    parts = deployment_parts(dep)
    assert [p.launch.name for p in parts] == ["bootstrap-0", "prefill-0", "decode-0", "proxy"]
    boot, prefill, decode, proxy = parts
    assert boot.launch.argv[-6:] == ["-m", "pdkv", "bootstrap", "--host", "0.0.0.0", "--port", "8998"][-6:]
    assert prefill.launch.env["CUDA_VISIBLE_DEVICES"] == "0" and decode.launch.env["CUDA_VISIBLE_DEVICES"] == "2"
    assert kv_config(prefill)["kv_connector_extra_config"] == {
        "mooncake_protocol": "rdma", "device_name": "mlx5_0", "bootstrap_server_address": "%s:8998" % prefill.launch.env["VLLM_HOST_IP"],
        "side_channel_port": 5561,  # after the two engines' KV events (pdkv.deploy.plan.ports)
    }
    assert kv_config(decode)["kv_role"] == "kv_consumer"
    i = proxy.launch.argv.index("--prefill")
    assert proxy.launch.argv[i + 1] == f"http://127.0.0.1:8100,{prefill.bootstrap_url}"
    assert proxy.launch.argv[proxy.launch.argv.index("--decode") + 1] == "http://127.0.0.1:8200"
    assert proxy.launch.argv[proxy.launch.argv.index("--connector") + 1] == "pdkv"  # what the proxy may let through (n > 1)


AUTO = {"profile": "p.json", "ttft_ms": 500, "itl_ms": 50, "prefill": {"min": 1, "max": 3}}


def test_autoscale_table_loads_with_its_defaults() -> None:
    a = deployment_from_dict(_dep(autoscale=AUTO)).autoscale
    assert a is not None and (a.prefill.min, a.prefill.max, a.decode.min, a.decode.max) == (1, 3, 1, 1)
    assert (a.quantile, a.interval_s, a.down_after_s, a.kubernetes) == (0.9, 5.0, 60.0, "hpa")
    assert deployment_from_dict(_dep()).autoscale is None


def test_autoscale_bounds_count_a_tables_replicas_as_engines() -> None:
    # Kubernetes: one table of N replicas is N engines of one workload, which the autoscaler scales within the bounds.
    data = _dep(prefill=[{"port": 8100, "replicas": 2}], autoscale={**AUTO, "prefill": {"min": 2, "max": 4}})
    assert deployment_from_dict(data).autoscale.prefill.min == 2
    with pytest.raises(ConfigError, match=r"1 prefill engines .* outside \[autoscale.prefill\]'s 2..4"):
        deployment_from_dict(_dep(prefill=[{"port": 8100}], autoscale={**AUTO, "prefill": {"min": 2, "max": 4}}))


def _dep(**overrides) -> dict:
    base = {"model": "/m", "host_ip": "10.0.0.5", "prefill": [{"port": 8100}, {"port": 8101}], "decode": [{"port": 8200}]}
    return {**base, **overrides}


def test_each_prefill_gets_its_own_standalone_bootstrap() -> None:
    parts = deployment_parts(deployment_from_dict(_dep()))
    boots = [p for p in parts if p.kind == "bootstrap"]
    assert [[(u.bind, u.port, u.setting) for u in b.ports] for b in boots] == [
        [("0.0.0.0", 8998, "[bootstrap] port")], [("0.0.0.0", 8999, "[bootstrap] port (the next free port after the bootstrap before)")]]
    prefills = [p for p in parts if p.kind == "prefill"]
    assert [p.bootstrap_url for p in prefills] == ["http://10.0.0.5:8998", "http://10.0.0.5:8999"]


def test_in_worker_bootstrap_sets_the_port_env_per_prefill() -> None:
    parts = deployment_parts(deployment_from_dict(_dep(bootstrap={"mode": "in-worker", "port": 9000})))
    assert not [p for p in parts if p.kind == "bootstrap"]
    prefills = [p for p in parts if p.kind == "prefill"]
    assert [p.launch.env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] for p in prefills] == ["9000", "9001"]
    assert all("bootstrap_server_address" not in kv_config(p)["kv_connector_extra_config"] for p in prefills)
    assert [("0.0.0.0", 9001), ("0.0.0.0", 5559), ("0.0.0.0", 5560)] == [(u.bind, u.port) for u in prefills[1].ports[1:4]]
    assert [u.what for u in prefills[1].ports] == ["HTTP", "bootstrap", "KV events publisher", "KV events replay", "side channel"]


def test_external_bootstrap_is_passed_to_prefill() -> None:
    dep = deployment_from_dict(_dep(prefill=[{"port": 8100}], bootstrap={"mode": "external", "url": "http://10.0.0.9:7000"}))
    prefill = next(p for p in deployment_parts(dep) if p.kind == "prefill")
    assert kv_config(prefill)["kv_connector_extra_config"]["bootstrap_server_address"] == "10.0.0.9:7000"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"model": "/m", "prefill": [{"port": 1}]}, "at least one"),
        (_dep(colour="blue"), "colour"),
        (_dep(connector="nixl"), "connector"),
        (_dep(bootstrap={"mode": "external"}), "needs url"),
        (_dep(restart="always"), "restart"),
        (_dep(decode=[{"port": 8200, "restart": "sometimes"}]), "restart"),
        (_dep(autoscale={"ttft_ms": 500, "itl_ms": 50}), "profile"),
        (_dep(autoscale={**AUTO, "prefill": {"min": 3, "max": 2}}), r"1 <= min <= max, got min = 3, max = 2"),
        (_dep(autoscale={**AUTO, "prefill": {"min": 1, "max": 1}}),
         r"2 prefill engines \(\[\[prefill\]\] tables x replicas\) lie outside \[autoscale.prefill\]'s 1..1"),
        (_dep(autoscale={**AUTO, "decode": {"min": 1, "max": 2}}, decode=[{"port": 8200, "replicas": 3}]), "3 decode engines"),
        (_dep(autoscale={**AUTO, "decode": {"min": 0, "max": 1}}), "autoscale.decode"),
        (_dep(autoscale={**AUTO, "quantile": 1.0}), "quantile"),
        (_dep(autoscale={**AUTO, "interval_s": 0}), "interval_s"),
        (_dep(autoscale={**AUTO, "kubernetes": "vpa"}), "kubernetes"),
    ],
)
def test_bad_deployments_are_config_errors(data: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        deployment_from_dict(data)


def test_restart_is_deployment_wide_and_per_part() -> None:
    parts = deployment_parts(deployment_from_dict(_dep(
        restart="no", bootstrap={"restart": "on-failure"}, decode=[{"port": 8200, "restart": "on-failure"}], proxy={"port": 8000})))
    assert {p.launch.name: p.restart for p in parts} == {
        "bootstrap-0": "on-failure", "bootstrap-1": "on-failure", "prefill-0": "no", "prefill-1": "no", "decode-0": "on-failure",
        "proxy": "no"}
    assert {p.restart for p in deployment_parts(deployment_from_dict(_dep()))} == {"on-failure"}  # the default


def test_each_prefill_names_the_standalone_bootstrap_it_registers_with() -> None:
    parts = deployment_parts(deployment_from_dict(_dep(connector="mooncake")))
    assert [p.registers_with for p in parts if p.kind == "prefill"] == ["bootstrap-0", "bootstrap-1"]
    # pdkv's connector renews its registration: a restarted bootstrap does not restart its prefill.
    renewing = deployment_parts(deployment_from_dict(_dep()))
    assert [p.registers_with for p in renewing if p.kind == "prefill"] == [None, None]
    in_worker = deployment_parts(deployment_from_dict(_dep(bootstrap={"mode": "in-worker"})))
    assert [p.registers_with for p in in_worker if p.kind == "prefill"] == [None, None]  # P serves its own


def test_the_key_protocol_is_a_config_error_naming_transport(tmp_path: Path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text('model = "/m"\nprotocol = "tcp"\n[[prefill]]\nport = 8100\n[[decode]]\nport = 8200\n')
    with pytest.raises(ConfigError, match=r"deploy.toml: the key `protocol` is now `transport`") as caught:
        load_deployment(path)
    assert caught.value.hint is not None and 'transport = "tcp"' in caught.value.hint
    assert deployment_from_dict(_dep(transport="tcp")).transport == "tcp"


def test_bad_toml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text("model = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_deployment(path)
    with pytest.raises(ConfigError, match="no deployment file"):
        load_deployment(tmp_path / "missing.toml")


def test_local_cpu_topology() -> None:
    dep = local_deployment(gpus=0)
    parts = deployment_parts(dep)
    assert [p.launch.name for p in parts] == ["bootstrap-0", "prefill-0", "decode-0", "proxy"]
    prefill, decode = parts[1], parts[2]
    for part, core in ((prefill, "0"), (decode, "1")):
        assert part.launch.env["VLLM_CPU_OMP_THREADS_BIND"] == core
        assert part.launch.env["VLLM_HOST_IP"] == "127.0.0.1"
        assert part.launch.env["HF_HUB_OFFLINE"] == "1"
        assert kv_config(part)["kv_connector"] == "PdkvConnector"
        assert kv_config(part)["kv_connector_extra_config"]["mooncake_protocol"] == "cma"  # both engines on this host
        argv = part.launch.argv
        assert argv[argv.index("--block-size") + 1] == "32"
        assert argv[argv.index("--served-model-name") + 1] == "tiny"
        # The tiny model's KV cache sized to it, on the command line; vLLM's GiB variable would override that.
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
        assert "VLLM_CPU_KVCACHE_SPACE" not in part.launch.env


def test_a_cpu_engines_kv_cache_size_comes_from_the_file_and_too_small_is_refused() -> None:
    sized = deployment_parts(deployment_from_dict(_dep(platform="cpu", cpu_kv_cache_bytes=256 << 20)))
    for part in (p for p in sized if p.kind in ("prefill", "decode")):
        assert part.launch.argv[part.launch.argv.index("--kv-cache-memory-bytes") + 1] == str(256 << 20)
        assert "VLLM_CPU_KVCACHE_SPACE" not in part.launch.env
    unset = [p for p in deployment_parts(deployment_from_dict(_dep(platform="cpu"))) if p.kind == "prefill"]
    assert unset[0].launch.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "--kv-cache-memory-bytes" not in unset[0].launch.argv
    assert local_deployment(gpus=0, model="/models/q").cpu_kv_cache_bytes is None  # a model of the user's: vLLM's GiB
    with pytest.raises(ConfigError, match=r"cpu_kv_cache_bytes must be at least 1,048,576 \(1 MiB\), got 4096"):
        deployment_from_dict(_dep(platform="cpu", cpu_kv_cache_bytes=4096))


def test_local_cpu_topology_with_vllms_connector_keeps_mooncake_tcp() -> None:
    dep = local_deployment(gpus=0, connector="mooncake")
    for part in deployment_parts(dep)[1:3]:
        assert kv_config(part)["kv_connector_extra_config"]["mooncake_protocol"] == "tcp"
    assert local_deployment(gpus=0, transport="tcp").transport == "tcp"


def test_cma_with_vllms_connector_is_refused() -> None:
    from pdkv.errors import UsageError
    from pdkv.deploy.plan.engine import EngineSpec, kv_transfer_config

    with pytest.raises(UsageError, match="cma is pdkv's own transport"):
        kv_transfer_config(EngineSpec(model="m", role="decode", connector="mooncake", transport="cma", platform="cpu"))


def test_local_gpu_topology_splits_gpus() -> None:
    parts = deployment_parts(local_deployment(gpus=2, model="/models/q"))
    assert [p.launch.env.get("CUDA_VISIBLE_DEVICES") for p in parts if p.spec] == ["0", "1"]
    one = deployment_parts(local_deployment(gpus=1, model="/models/q"))
    assert all("--gpu-memory-utilization" in p.launch.argv for p in one if p.spec)


# --- engine agreement (reads config.json files only) ------------------------------


def _model(tmp_path: Path, name: str, **config) -> str:
    d = tmp_path / name
    d.mkdir()
    base = {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
    (d / "config.json").write_text(json.dumps({**base, **config}))
    return str(d)


def _parts(p: dict, d: dict, **top):
    data = {"model": top.pop("model"), "host_ip": "127.0.0.1", "prefill": [{"port": 8100, **p}], "decode": [{"port": 8200, **d}], **top}
    return deployment_parts(deployment_from_dict(data))


def test_agreeing_engines_have_no_problems(tmp_path: Path) -> None:
    assert check_engines(_parts({}, {}, model=_model(tmp_path, "m"), block_size=16)) == []


def test_block_size_mismatch(tmp_path: Path) -> None:
    problems = check_engines(_parts({"block_size": 32}, {"block_size": 64}, model=_model(tmp_path, "m")))
    assert [p.what for p in problems] == ["block size differs: P 32, D 64"]
    assert "same block_size" in problems[0].fix


def test_dtype_model_and_tp_mismatches(tmp_path: Path) -> None:
    other = _model(tmp_path, "other", num_hidden_layers=4)
    parts = _parts({"dtype": "float16", "tp": 2}, {"model": other, "tp": 3}, model=_model(tmp_path, "m"), connector="mooncake")
    problems = check_engines(parts)
    text = " | ".join(p.what for p in problems)
    assert "P serves" in text and "dtype float16 differs from D's bfloat16" in text and "TP sizes 2 (P) and 3 (D)" in text


def test_cores_this_host_lacks_are_a_problem(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    model = _model(tmp_path, "m")
    [problem] = check_engines(_parts({"tp": 2, "omp_bind": "0-3"}, {"omp_bind": "1"}, model=model, platform="cpu", block_size=32))
    assert "names core(s) 2, 3, and this host has 2 cores" in problem.what and "cores 0-1" in problem.fix
    assert check_engines(_parts({"tp": 2, "omp_bind": "0-1"}, {"omp_bind": "1"}, model=model, platform="cpu", block_size=32)) == []


def _numa(root: Path, nodes: int) -> str:
    for n in range(nodes):
        (root / f"sys/devices/system/node/node{n}").mkdir(parents=True)
        (root / f"sys/devices/system/node/node{n}/cpulist").write_text(f"{n}\n")
    return str(root)


def test_cpu_tp_without_omp_bind_on_fewer_numa_nodes_than_ranks_says_what_to_write(tmp_path: Path,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM's CPU worker would die inside its start-up: "Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers".
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setenv("PDKV_SYS_ROOT", _numa(tmp_path / "one", 1))
    model = _model(tmp_path, "m")
    [problem] = check_engines(_parts({"tp": 2}, {"omp_bind": "3"}, model=model, platform="cpu", block_size=32))
    assert problem.part == "prefill-0" and "tp 2 on CPU without omp_bind" in problem.what and "this host has 1" in problem.what
    assert 'omp_bind = "0-1|2-3"' in problem.fix
    assert check_engines(_parts({"tp": 2, "omp_bind": "0-1"}, {"omp_bind": "3"}, model=model, platform="cpu", block_size=32)) == []
    monkeypatch.setenv("PDKV_SYS_ROOT", _numa(tmp_path / "two", 2))  # a node per rank: vLLM's own binding works
    assert check_engines(_parts({"tp": 2}, {"omp_bind": "3"}, model=model, platform="cpu", block_size=32)) == []


def test_more_ranks_than_cores_is_said_not_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    model = _model(tmp_path, "m")
    parts = _parts({"tp": 2, "omp_bind": "0-1"}, {"omp_bind": "1"}, model=model, platform="cpu", block_size=32)
    assert check_engines(parts) == []
    [line] = shared_cores(parts)
    assert line.startswith("decode-0 shares core(s) 1 with prefill-0: this host has 2 cores for 3 engine ranks")
    assert shared_cores(_parts({"omp_bind": "0"}, {"omp_bind": "1"}, model=model, platform="cpu", block_size=32)) == []


def test_unequal_tp_that_divides_is_accepted_for_either_connector(tmp_path: Path) -> None:
    model = _model(tmp_path, "m")  # 2 KV heads
    for p_tp, d_tp in ((2, 1), (1, 2)):
        assert check_engines(_parts({"tp": p_tp}, {"tp": d_tp}, model=model)) == []
        assert check_engines(_parts({"tp": p_tp}, {"tp": d_tp}, model=model, connector="mooncake")) == []


def test_unequal_tp_whose_heads_do_not_split_is_refused_with_the_reason(tmp_path: Path) -> None:
    model = _model(tmp_path, "m", num_key_value_heads=6, num_attention_heads=12)
    [problem] = check_engines(_parts({"tp": 1}, {"tp": 4}, model=model))
    assert "6 KV heads do not split evenly over TP 4" in problem.what and "split the KV heads" in problem.fix


def test_unequal_tp_of_an_mla_model_is_refused_for_pdkvs_connector(tmp_path: Path) -> None:
    model = _model(tmp_path, "m", kv_lora_rank=512, qk_rope_head_dim=64)
    [problem] = check_engines(_parts({"tp": 2}, {"tp": 1}, model=model))
    assert "MLA" in problem.what and "mooncake" in problem.fix


def test_same_config_under_another_path_is_the_same_model(tmp_path: Path) -> None:
    assert check_engines(_parts({}, {"model": _model(tmp_path, "copy")}, model=_model(tmp_path, "m"))) == []


def test_unreadable_and_missing_models(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    problems = check_engines(_parts({}, {"model": str(tmp_path / "nope")}, model=str(broken)))
    assert any("config unreadable" in p.what for p in problems)
    assert any("does not exist" in p.what for p in problems)


def test_cpu_block_size_must_be_a_multiple_of_32(tmp_path: Path) -> None:
    problems = check_engines(_parts({}, {}, model=_model(tmp_path, "m"), platform="cpu", block_size=16))
    assert {p.part for p in problems} == {"prefill-0", "decode-0"}
    assert all("multiple of 32" in p.what for p in problems)


def test_cma_is_refused_for_engines_that_keep_the_kv_on_a_gpu(tmp_path: Path) -> None:
    model = _model(tmp_path, "m")
    problems = check_engines(_parts({}, {}, model=model, platform="gpu", transport="cma"))
    assert {p.part for p in problems} == {"prefill-0", "decode-0"}
    assert all("host memory" in p.what and "ipc" in p.fix for p in problems)
    assert check_engines(_parts({}, {}, model=model, platform="cpu", block_size=32, transport="cma")) == []


def test_cma_preflight_probes_this_host_once_and_refuses_a_forbidding_yama(tmp_path: Path) -> None:
    model = _model(tmp_path, "m")
    cma = _parts({}, {}, model=model, platform="cpu", block_size=32, transport="cma")
    assert check_cma(cma) == []  # the live probe: a real child process written into, bytes checked
    assert check_cma(_parts({}, {}, model=model, platform="cpu", block_size=32, transport="tcp"), proc_root=str(tmp_path / "none")) == []
    yama = tmp_path / "proc" / "sys/kernel/yama"
    yama.mkdir(parents=True)
    (yama / "ptrace_scope").write_text("3\n")
    [problem] = check_cma(cma, proc_root=str(tmp_path / "proc"))
    assert "ptrace_scope is 3" in problem.what and "--transport tcp" in problem.fix


def test_vllms_connector_on_cpu_is_one_problem_unless_the_shim_is_on_the_pythonpath(tmp_path: Path) -> None:
    model = _model(tmp_path, "m")
    parts = _parts({}, {}, model=model, platform="cpu", block_size=32, transport="tcp", connector="mooncake")
    [problem] = check_connector(parts, environ={})
    assert problem.part == "prefill-0, decode-0"
    assert "Cannot access accelerator device" in problem.what and "--connector pdkv" in problem.fix
    shim = Path(__file__).resolve().parents[1] / "shims" / "cpu_accelerator"
    assert check_connector(parts, environ={"PYTHONPATH": f"/elsewhere:{shim}"}) == []  # the caller's PYTHONPATH
    with_env = _parts(
        {}, {}, model=model, platform="cpu", block_size=32, transport="tcp", connector="mooncake", env={"PYTHONPATH": str(shim)}
    )
    assert check_connector(with_env, environ={}) == []  # the deployment's env
    assert len(check_connector(parts, environ={"PYTHONPATH": str(tmp_path)})) == 1  # another folder is not the shim
    assert check_connector(_parts({}, {}, model=model, platform="cpu", block_size=32, transport="tcp"), environ={}) == []
    assert check_connector(_parts({}, {}, model=model, platform="gpu", connector="mooncake"), environ={}) == []


def test_problems_become_one_preflight_error_one_line_each(tmp_path: Path) -> None:
    problems = check_engines(_parts({"block_size": 32}, {"block_size": 64, "dtype": "float32"}, model=_model(tmp_path, "m")))
    with pytest.raises(PreflightError) as info:
        raise_problems(problems)
    lines = info.value.message.splitlines()
    assert lines[0] == "pre-flight found 2 problems:" and len(lines) == 3
    assert all("fix:" in line for line in lines[1:])
    raise_problems([])  # no problems, no error


def test_read_samples_reads_the_proxys_metrics() -> None:
    from pdkv.proxy.metrics import ProxyMetrics

    text = ProxyMetrics().render([("prefill", "http://127.0.0.1:8100", True, 3), ("decode", "http://127.0.0.1:8200", False, 0)])
    samples = {(n, msgspec.json.encode(sorted(lab.items())).decode()): v for n, lab, v in read_samples(text)}
    assert samples[("pdkv_proxy_outstanding_requests", '[["role","prefill"],["url","http://127.0.0.1:8100"]]')] == 3
    assert samples[("pdkv_proxy_backend_up", '[["role","decode"],["url","http://127.0.0.1:8200"]]')] == 0


def test_read_samples_reads_escaped_labels_and_skips_a_line_it_cannot_read() -> None:
    text = (
        '# TYPE pdkv_proxy_errors_total counter\n'
        'pdkv_proxy_errors_total{cause="said \\"no\\""} 2.0\n'
        '# TYPE up gauge\n'
        'up 1\n'
        'this is not exposition text\n'
    )
    samples = read_samples(text)
    assert ("pdkv_proxy_errors_total", {"cause": 'said "no"'}, 2.0) in samples
    assert not any(name == "this" for name, _, _ in samples)
    assert read_samples("") == []


def test_every_engine_publishes_kv_events_on_its_own_ports_and_the_proxy_follows_them() -> None:
    from pdkv.deploy.plan.engine import kv_events_config

    parts = deployment_parts(deployment_from_dict(_dep(proxy={"port": 8000, "policy": "kv-aware", "local_prefill_tokens": 128})))
    engines = [p for p in parts if p.kind in ("prefill", "decode")]
    configs = [json.loads(p.launch.argv[p.launch.argv.index("--kv-events-config") + 1]) for p in engines]
    assert configs == [kv_events_config(5557 + 2 * k) for k in range(len(engines))]
    assert configs[0] == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    proxy = next(p for p in parts if p.kind == "proxy").launch.argv
    follows = [proxy[i + 1] for i, a in enumerate(proxy) if a == "--kv-events"]
    assert len(follows) == len(engines)
    assert follows[0] == "http://127.0.0.1:8100=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558"
    assert proxy[proxy.index("--policy") + 1] == "kv-aware" and proxy[proxy.index("--local-prefill-tokens") + 1] == "128"
    off = deployment_parts(deployment_from_dict(_dep(kv_events=False)))
    assert not any("--kv-events-config" in p.launch.argv or "--kv-events" in p.launch.argv for p in off)


def test_a_data_parallel_engine_takes_two_events_ports_per_rank_and_the_proxy_routes_it_by_its_own_view() -> None:
    dep = _dep(prefill=[{"port": 8100, "extra_args": ["--data-parallel-size", "2"]}, {"port": 8101}])
    parts = deployment_parts(deployment_from_dict(dep))
    engines = [p for p in parts if p.kind in ("prefill", "decode")]
    bound = sorted(u.port for p in engines for u in p.ports if u.what.startswith("KV events"))
    assert bound == [5557, 5558, 5559, 5560, 5561, 5562, 5563, 5564]  # DP 2: four; the others: two each
    assert len(set(bound)) == len(bound)
    proxy = next(p for p in parts if p.kind == "proxy").launch.argv
    follows = [proxy[i + 1].split("=", 1)[0] for i, a in enumerate(proxy) if a == "--kv-events"]
    assert follows == ["http://127.0.0.1:8101", "http://127.0.0.1:8200"]


def test_socket_settings_of_the_file_reach_the_connector_and_the_port_check() -> None:
    dep = deployment_from_dict(_dep(transport="socket", platform="cpu", socket_connections=3,
                                    decode=[{"port": 8200, "tp": 2, "socket_port": 7100}]))
    parts = {p.kind: p for p in deployment_parts(dep)}
    assert kv_config(parts["prefill"])["kv_connector_extra_config"]["socket_connections"] == 3
    extra = kv_config(parts["decode"])["kv_connector_extra_config"]
    assert extra == {"mooncake_protocol": "socket", "socket_port": 7100}
    # Socket buffers go to both ends when the file sets them, to neither when it does not.
    sized = deployment_from_dict(_dep(transport="socket", platform="cpu", socket_buffer_bytes=1 << 20))
    for part in deployment_parts(sized):
        if part.kind in ("prefill", "decode"):
            assert kv_config(part)["kv_connector_extra_config"]["socket_buffer_bytes"] == 1 << 20
    assert "socket_buffer_bytes" not in kv_config(parts["prefill"])["kv_connector_extra_config"]
    # Out-of-range settings are refused when the file is read, before any engine starts.
    for key, bad, needle in (("socket_buffer_bytes", 100, "socket_buffer_bytes must be 0"), ("socket_connections", 65, r"0\.\.64")):
        with pytest.raises(ConfigError, match=needle):
            deployment_from_dict(_dep(transport="socket", platform="cpu", **{key: bad}))
    listeners = [u for u in parts["decode"].ports if u.what.startswith("KV listener")]
    assert [(u.bind, u.port, u.setting) for u in listeners] == [("0.0.0.0", 7100, "[[decode]] 1 socket_port"),
                                                                 ("0.0.0.0", 7101, "[[decode]] 1 socket_port")]
    # without socket_port in the file the allocator gives the listener ports after the others, not the system
    derived = {p.kind: p for p in deployment_parts(deployment_from_dict(_dep(transport="socket", platform="cpu",
                                                                             decode=[{"port": 8200}])))}
    given = kv_config(derived["decode"])["kv_connector_extra_config"]["socket_port"]
    assert given > 0 and any(u.port == given and u.what == "KV listener" for u in derived["decode"].ports)
    tcp = {p.kind: p for p in deployment_parts(deployment_from_dict(_dep(decode=[{"port": 8200, "socket_port": 7100}])))}
    assert "socket_port" not in kv_config(tcp["decode"])["kv_connector_extra_config"]  # other transports: ignored


def test_the_send_process_setting_reaches_each_prefills_connector_alone_and_needs_the_socket_transport() -> None:
    for said in (False, True):
        parts = deployment_parts(deployment_from_dict(_dep(transport="socket", socket_send_process=said)))
        extras = {p.kind: kv_config(p)["kv_connector_extra_config"] for p in parts if p.kind in ("prefill", "decode")}
        assert extras["prefill"]["socket_send_process"] is said and "socket_send_process" not in extras["decode"]
    unset = deployment_parts(deployment_from_dict(_dep(transport="socket")))
    assert not any("socket_send_process" in kv_config(p)["kv_connector_extra_config"] for p in unset if p.kind == "prefill")
    with pytest.raises(ConfigError, match="socket_send_process needs transport = \"socket\", not 'tcp'"):
        deployment_from_dict(_dep(transport="tcp", socket_send_process=True))


def test_writing_layer_by_layer_reaches_each_prefills_connector_alone_and_needs_the_socket_transport() -> None:
    parts = deployment_parts(deployment_from_dict(_dep(transport="socket", platform="cpu", socket_write_layers=True)))
    extras = {p.launch.name: kv_config(p)["kv_connector_extra_config"] for p in parts if p.kind in ("prefill", "decode")}
    assert [n for n, e in extras.items() if e.get("socket_write_layers") is True] == ["prefill-0", "prefill-1"]
    assert {n: e.get("socket_layer_groups") for n, e in extras.items() if n.startswith("prefill")} == {"prefill-0": 6, "prefill-1": 6}
    assert not any("socket_layer_groups" in e for n, e in extras.items() if n.startswith("decode"))
    grouped = deployment_parts(deployment_from_dict(_dep(transport="socket", socket_write_layers=True, socket_layer_groups=36)))
    assert {kv_config(p)["kv_connector_extra_config"].get("socket_layer_groups") for p in grouped if p.kind == "prefill"} == {36}
    with pytest.raises(ConfigError, match="socket_layer_groups must be 1..1024, got 0"):
        deployment_from_dict(_dep(transport="socket", socket_write_layers=True, socket_layer_groups=0))
    off = deployment_parts(deployment_from_dict(_dep(transport="socket", platform="cpu")))
    assert not any("socket_write_layers" in kv_config(p)["kv_connector_extra_config"] for p in off if p.kind == "prefill")
    for transport in ("tcp", "rdma", "cma", "ipc"):
        with pytest.raises(ConfigError, match=f"socket_write_layers needs transport = \"socket\", not '{transport}'"):
            deployment_from_dict(_dep(transport=transport, socket_write_layers=True))
