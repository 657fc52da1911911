"""pdkv.deploy.plan.engine's pure half: the vLLM command line and environment built from an EngineSpec."""

from __future__ import annotations

import ipaddress
import json
import re
import sys

import msgspec
import pytest

from pdkv.deploy.plan.engine import (
    API_SERVER_MODULE,
    EngineSpec,
    engine_argv,
    engine_env,
    engine_launch,
    kv_transfer_config,
    vllm_console_script_works,
)
from pdkv.deploy.plan.cores import parse_cores
from pdkv.deploy.plan.launch import bootstrap_address, http_url
from pdkv.errors import StartError, UsageError
from pdkv.peer_address import advertised_address


def kv_config_of(argv: list[str]) -> dict:
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.mark.parametrize(("role", "kv_role"), [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_roles_map_to_vllm_kv_roles(role: str, kv_role: str) -> None:
    config = kv_transfer_config(EngineSpec(model="m", role=role, host_ip="10.0.0.1"))
    assert config is not None and config["kv_role"] == kv_role


def test_pdkv_connector_is_loaded_from_its_module() -> None:
    config = kv_transfer_config(EngineSpec(model="m", role="prefill", connector="pdkv", transport="tcp"))
    assert config == {
        "kv_connector": "PdkvConnector",
        "kv_connector_module_path": "pdkv.connector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "tcp"},
        "kv_load_failure_policy": "recompute",
    }


@pytest.mark.parametrize(("connector", "asked", "policy"), [("pdkv", None, "recompute"), ("pdkv", "fail", "fail"),
                                                            ("mooncake", None, None), ("mooncake", "recompute", "recompute")])
def test_a_failed_kv_load_is_recomputed_by_default_with_pdkvs_connector(connector: str, asked: str | None, policy: str | None) -> None:
    config = kv_transfer_config(EngineSpec(model="m", role="decode", connector=connector, transport="tcp", load_failure=asked))
    assert config is not None and config.get("kv_load_failure_policy") == policy


def test_mooncake_connector_uses_vllm_key_names() -> None:
    spec = EngineSpec(model="m", role="prefill", connector="mooncake", transport="rdma", device="mlx5_0", bootstrap_url="http://10.0.0.2:8998/")
    config = kv_transfer_config(spec)
    assert config == {
        "kv_connector": "MooncakeConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"mooncake_protocol": "rdma", "device_name": "mlx5_0", "bootstrap_server_address": "10.0.0.2:8998"},
    }


def test_decode_is_not_told_a_bootstrap_address() -> None:
    config = kv_transfer_config(EngineSpec(model="m", role="decode", bootstrap_url="http://10.0.0.2:8998"))
    assert config is not None and "bootstrap_server_address" not in config["kv_connector_extra_config"]


def test_colocated_engine_has_no_kv_transfer_config() -> None:
    argv = engine_argv(EngineSpec(model="m", launcher="module"))
    assert "--kv-transfer-config" not in argv


def test_module_launcher_command_line() -> None:
    spec = EngineSpec(model="/models/q", host="127.0.0.1", port=8100, role="prefill", tp=2, dtype="bfloat16", block_size=32,
                      max_model_len=2048, served_model_name="q", launcher="module", extra_args=("--enforce-eager",))
    argv = engine_argv(spec)
    assert argv[:5] == [sys.executable, "-m", API_SERVER_MODULE, "--model", "/models/q"]
    flags = dict(zip(argv[5:-3:2], argv[6:-3:2], strict=True))
    assert flags == {"--host": "127.0.0.1", "--port": "8100", "--served-model-name": "q", "--tensor-parallel-size": "2",
                     "--dtype": "bfloat16", "--block-size": "32", "--max-model-len": "2048"}
    assert argv[-3] == "--kv-transfer-config" and argv[-1] == "--enforce-eager"


def test_serve_launcher_command_line() -> None:
    argv = engine_argv(EngineSpec(model="/models/q", port=9000, launcher="serve"))
    assert argv[:3] == ["vllm", "serve", "/models/q"]
    assert "--model" not in argv


def test_auto_launcher_follows_the_console_script_check() -> None:
    argv = engine_argv(EngineSpec(model="m"))
    assert (argv[0] == "vllm") == vllm_console_script_works()


def test_gpu_env() -> None:
    env = engine_env(EngineSpec(model="m", role="prefill", gpu="0,1", host_ip="10.0.0.5", bootstrap_port=9000))
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "VLLM_HOST_IP": "10.0.0.5", "VLLM_MOONCAKE_BOOTSTRAP_PORT": "9000"}


def test_cpu_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    env = engine_env(EngineSpec(model="m", role="decode", platform="cpu", host_ip="127.0.0.1", omp_bind="1", cpu_kvcache_gib=2,
                                extra_env={"PDKV_X": "1"}))
    assert env == {"VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "2", "HF_HUB_OFFLINE": "1", "VLLM_USE_AOT_COMPILE": "0",
                   "VLLM_CPU_OMP_THREADS_BIND": "1", "PDKV_X": "1"}
    # An exact KV cache size goes on the command line, and vLLM's variable (which would override it) is left out.
    exact = EngineSpec(model="m", platform="cpu", cpu_kv_cache_bytes=64 << 20)
    assert "VLLM_CPU_KVCACHE_SPACE" not in engine_env(exact)
    argv = engine_argv(exact)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(64 << 20)
    assert "--kv-cache-memory-bytes" not in engine_argv(EngineSpec(model="m", platform="gpu", cpu_kv_cache_bytes=64 << 20))
    # The caller's own choice is kept.
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    assert "VLLM_USE_AOT_COMPILE" not in engine_env(EngineSpec(model="m", platform="cpu"))


@pytest.mark.parametrize(
    ("bind", "cores"), [("1", [1]), ("0-3", [0, 1, 2, 3]), ("0,2", [0, 2]), ("0-1|4-5", [0, 1, 4, 5]), ("auto", None), (None, None)]
)
def test_cpu_engines_are_bound_to_their_omp_cores(bind, cores) -> None:
    spec = EngineSpec(model="m", role="decode", platform="cpu", host_ip="127.0.0.1", omp_bind=bind, launcher="module")
    assert engine_launch(spec).cpus == cores
    assert engine_launch(msgspec.structs.replace(spec, platform="gpu")).cpus is None


@pytest.mark.parametrize(("bind", "tp", "env"), [("0-1", 2, "0|1"), ("0-3", 2, "0,1|2,3"), ("0-4", 2, "0,1|2,3"), ("0|1", 2, "0|1"),
                                                  ("0-3", 1, "0-3"), ("auto", 2, "auto")])
def test_cpu_ranks_of_one_engine_get_cores_of_their_own(bind, tp, env) -> None:
    spec = EngineSpec(model="m", role="decode", platform="cpu", host_ip="127.0.0.1", omp_bind=bind, tp=tp, launcher="module")
    assert engine_env(spec)["VLLM_CPU_OMP_THREADS_BIND"] == env


def test_too_few_cores_for_the_ranks_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=re.escape("gives 1 core(s) to 2 TP ranks")):
        engine_env(EngineSpec(model="m", role="decode", platform="cpu", host_ip="127.0.0.1", omp_bind="0", tp=2))


def test_unreadable_core_list_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="core list"):
        parse_cores("zero")


def test_advertised_address_is_never_loopback_unless_asked() -> None:
    try:
        expected = advertised_address()
    except StartError:
        pytest.skip("this host has no routable address")
    assert not ipaddress.ip_address(expected).is_loopback
    assert engine_env(EngineSpec(model="m", role="prefill"))["VLLM_HOST_IP"] == expected


def test_bootstrap_address_forms() -> None:
    assert bootstrap_address("http://10.0.0.2:8998") == "10.0.0.2:8998"
    assert bootstrap_address("10.0.0.2:8998") == "10.0.0.2:8998"
    assert bootstrap_address("http://[fd00::2]:8998/") == "[fd00::2]:8998"
    with pytest.raises(UsageError):
        bootstrap_address("http://10.0.0.2")


def test_http_url_reaches_wildcard_binds_locally() -> None:
    assert http_url("0.0.0.0", 8000) == "http://127.0.0.1:8000"
    assert http_url("::", 8000) == "http://[::1]:8000"
    assert http_url("10.1.2.3", 81) == "http://10.1.2.3:81"


def test_plan_rejects_bad_port() -> None:
    with pytest.raises(UsageError):
        engine_launch(EngineSpec(model="m", port=70000))


def test_kv_events_publish_on_a_wildcard_and_replay_on_the_next_port() -> None:
    from pdkv.deploy.plan.engine import kv_events_config, kv_events_endpoints

    argv = engine_argv(EngineSpec(model="/m", port=8100, launcher="module", kv_events_port=6000))
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000", "replay_endpoint": "tcp://*:6001"}
    assert "--kv-events-config" not in engine_argv(EngineSpec(model="/m", launcher="module"))
    assert kv_events_endpoints("0.0.0.0", 6000) == ("tcp://127.0.0.1:6000", "tcp://127.0.0.1:6001")
    assert kv_events_endpoints("::1", 6000)[0] == "tcp://[::1]:6000"
    with pytest.raises(UsageError):
        kv_events_config(65535)


@pytest.mark.parametrize(
    ("args", "size"),
    [((), 1), (("--data-parallel-size", "4"), 4), (("-dp", "2"), 2), (("--data-parallel-size=8",), 8),
     (("--data-parallel-size", "x"), 1), (("--data-parallel-size",), 1), (("--data-parallel-size", "0"), 1)],
)
def test_the_data_parallel_size_is_read_from_vllms_arguments(args, size) -> None:
    from pdkv.deploy.plan.engine import data_parallel_size

    assert data_parallel_size(args) == size
    assert EngineSpec(model="m", extra_args=args).dp_size == size


def test_with_data_parallelism_every_rank_publishes_and_replays_on_ports_no_other_rank_binds() -> None:
    from pdkv.deploy.plan.engine import kv_events_config, kv_events_endpoints

    spec = EngineSpec(model="/m", launcher="module", kv_events_port=6000, extra_args=("--data-parallel-size", "3"))
    argv = engine_argv(spec)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert (config["endpoint"], config["replay_endpoint"]) == ("tcp://*:6000", "tcp://*:6003")
    # vLLM offsets both by the rank: publishers 6000-6002, replays 6003-6005.
    bound = [port + r for port in (6000, 6003) for r in range(3)]
    assert len(set(bound)) == 6
    assert kv_events_endpoints("10.0.0.2", 6000, dp_size=3, dp_rank=2) == ("tcp://10.0.0.2:6002", "tcp://10.0.0.2:6005")
    with pytest.raises(UsageError):
        kv_events_config(65531, dp_size=3)
    assert kv_events_config(65530, dp_size=3)["replay_endpoint"] == "tcp://*:65533"


def test_ipc_engines_share_kv_by_descriptor_unless_their_arguments_turn_vllms_extensible_cache_off() -> None:
    from pdkv.connector.config import kv_cache_access, load_config

    def extra(*args: str) -> dict:
        config = kv_transfer_config(EngineSpec(model="m", role="decode", transport="ipc", gpu="0", extra_args=args))
        assert config is not None
        return config["kv_connector_extra_config"]

    assert extra("--max-num-seqs", "32")["ipc_handles"] == "fd"
    assert kv_cache_access(load_config(extra())) == ("EXPORTS_FD",)
    for off in (["--kv-cache-memory-bytes", "4294967296"], ["--num-gpu-blocks-override=900"], ["--no-enable-extensible-kv-cache"]):
        assert extra(*off)["ipc_handles"] == "legacy", off
        assert kv_cache_access(load_config(extra(*off))) == ("LEGACY_IPC",)
    tcp = kv_transfer_config(EngineSpec(model="m", role="decode", transport="tcp", extra_args=("--kv-cache-memory-bytes", "1")))
    assert tcp is not None and "ipc_handles" not in tcp["kv_connector_extra_config"]
    assert kv_cache_access(load_config(tcp["kv_connector_extra_config"])) == ("REGISTERS",)
    assert kv_cache_access(load_config({"transport": "cma"})) == ()


def test_socket_prefills_export_their_kv_for_the_send_process_and_decodes_do_not() -> None:
    from pdkv.connector.config import kv_cache_access, load_config

    def extra(role: str, *args: str) -> dict:
        config = kv_transfer_config(EngineSpec(model="m", role=role, transport="socket", gpu="0", extra_args=args))
        assert config is not None
        return config["kv_connector_extra_config"]

    assert extra("prefill")["ipc_handles"] == "fd" and "ipc_handles" not in extra("decode")
    assert kv_cache_access(load_config(extra("prefill")), producer=True) == ("EXPORTS_FD",)
    assert kv_cache_access(load_config(extra("prefill", "--no-enable-extensible-kv-cache")), producer=True) == ("LEGACY_IPC",)
    assert kv_cache_access(load_config(extra("decode")), producer=False) == ()
    assert kv_cache_access(load_config(extra("prefill")), producer=True, on_gpu=False) == ()  # vLLM 0.34 CPU: refused
    own = load_config({**extra("prefill"), "socket_send_process": False})
    assert kv_cache_access(own, producer=True) == ()
    assert own.sends_from_process(on_gpu=True) is False
    assert load_config(extra("prefill")).sends_from_process(on_gpu=True)
    assert not load_config(extra("prefill")).sends_from_process(on_gpu=False)
