"""`pdkv up`: --dry-run output for both roles and connectors, and each pre-flight failure (nothing starts)."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest

from pdkv.cli import run
from support.ports import free_port


# pdkv up's own vLLM logging configuration (pdkv.deploy.plan.vllm_logging), under the default --log-dir.
LOGGING = {"VLLM_LOGGING_CONFIG_PATH": str(Path(".pdkv/logs").resolve() / "vllm-logging.json")}


def dry_run(capsys, *args: str) -> list[dict]:
    code = run(["up", "--dry-run", "--json", *args])  # first: anything after "--" goes to vLLM
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)["parts"]


@pytest.mark.parametrize("connector", ["pdkv", "mooncake"])
@pytest.mark.parametrize(("role", "kv_role", "port"), [("prefill", "kv_producer", "8100"), ("decode", "kv_consumer", "8200")])
def test_dry_run_json_for_each_role_and_connector(capsys, connector: str, role: str, kv_role: str, port: str) -> None:
    (part,) = dry_run(capsys, "--role", role, "--model", "/models/Qwen3-8B", "--connector", connector, "--platform", "gpu",
                      "--gpu", "2", "--device", "mlx5_0", "--host-ip", "10.0.0.5")
    argv = part["argv"]
    assert part["name"] == role and part["url"] == f"http://127.0.0.1:{port}"
    assert argv[argv.index("--port") + 1] == port
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_role"] == kv_role
    assert config["kv_connector"] == {"pdkv": "PdkvConnector", "mooncake": "MooncakeConnector"}[connector]
    assert ("kv_connector_module_path" in config) == (connector == "pdkv")
    assert config["kv_connector_extra_config"] == {"mooncake_protocol": "rdma", "device_name": "mlx5_0"}
    expected_env = {"CUDA_VISIBLE_DEVICES": "2", "VLLM_HOST_IP": "10.0.0.5"}
    if role == "prefill":
        expected_env["VLLM_MOONCAKE_BOOTSTRAP_PORT"] = "8998"
    assert part["env"] == {**expected_env, **LOGGING}
    assert part["command"].startswith("CUDA_VISIBLE_DEVICES=2 VLLM_HOST_IP=10.0.0.5 ")


def test_dry_run_prefill_with_standalone_bootstrap_and_extra_args(capsys) -> None:
    (part,) = dry_run(capsys, "--role", "prefill", "--model", "m", "--platform", "gpu", "--bootstrap", "http://10.0.0.2:7000",
                      "--transport", "tcp", "--host-ip", "10.0.0.5", "--", "--enforce-eager", "--max-num-seqs", "8")
    argv = part["argv"]
    assert argv[-3:] == ["--enforce-eager", "--max-num-seqs", "8"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"] == {"mooncake_protocol": "tcp", "bootstrap_server_address": "10.0.0.2:7000"}
    assert "VLLM_MOONCAKE_BOOTSTRAP_PORT" not in part["env"]


def test_dry_run_cpu_role_sets_cpu_env(capsys, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    (part,) = dry_run(capsys, "--role", "decode", "--model", "m", "--platform", "cpu", "--omp-bind", "1", "--host-ip", "127.0.0.1")
    assert part["env"] == {
        "VLLM_HOST_IP": "127.0.0.1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_USE_AOT_COMPILE": "0",
        "VLLM_CPU_OMP_THREADS_BIND": "1", **LOGGING
    }
    assert part["argv"][part["argv"].index("--block-size") + 1] == "32"


def test_dry_run_local_topology(capsys) -> None:
    parts = dry_run(capsys, "--platform", "cpu")
    assert [p["name"] for p in parts] == ["bootstrap-0", "prefill-0", "decode-0", "proxy"]
    proxy = parts[3]["argv"]
    assert proxy[proxy.index("--prefill") + 1] == "http://127.0.0.1:8100,http://127.0.0.1:8998"
    binds = {p["name"]: p["env"].get("VLLM_CPU_OMP_THREADS_BIND") for p in parts[1:3]}
    assert binds["prefill-0"] != binds["decode-0"]


def test_dry_run_human_output_is_a_pastable_command(capsys) -> None:
    code = run(["up", "--role", "decode", "--model", "m", "--platform", "gpu", "--gpu", "1", "--host-ip", "10.0.0.5", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "# decode (http://127.0.0.1:8200)" in out
    assert "CUDA_VISIBLE_DEVICES=1 VLLM_HOST_IP=10.0.0.5" in out and "--kv-transfer-config" in out


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["--role", "middle"], "unknown role"),
        (["--connector", "nixl", "--role", "prefill"], "--connector"),
        (["--role", "decode", "--bootstrap", "http://127.0.0.1:1"], "--bootstrap is for prefill"),
        (["-f", "x.toml", "--role", "prefill"], "either -f FILE or --role"),
    ],
)
def test_usage_errors_exit_2(capsys, args: list[str], match: str) -> None:
    assert run(["up", *args, "--dry-run"]) == 2
    assert match in capsys.readouterr().err


# --- pre-flight: each failure is one line naming the fix, exit 3, nothing started ----------


def preflight_fails(capsys, *args: str) -> str:
    # --timeout 1 bounds the damage should a regression let pre-flight pass.
    code = run(["up", *args, "--timeout", "1", "--quiet", "--json"])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "pre-flight" in err
    # Without a deployment key `pdkv up` first warns of what listens beyond loopback (one JSON line each).
    return "\n".join(line for line in err.splitlines() if not line.startswith('{"event": "warning"'))


def test_preflight_port_taken(capsys, qwen3_8b: Path, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        err = preflight_fails(capsys, "--role", "decode", "--model", str(qwen3_8b), "--platform", "cpu",
                              "--listen", "127.0.0.1", "--host-ip", "127.0.0.1", "--port", str(port), "--log-dir", str(tmp_path))
    assert f"decode: port {port} on 127.0.0.1 (HTTP, from --port) is held by another process" in err
    assert "hint: stop what holds it" in err and "or change --port" in err
    assert not list(tmp_path.iterdir())  # no part was started, so no log was opened


def test_preflight_checks_the_ports_of_the_engines_autoscale_may_add_naming_the_part_and_the_setting(
        capsys, qwen3_8b: Path, tmp_path: Path) -> None:
    from support.planner_profiles import write_profile

    write_profile(tmp_path / "tiny.profile.json")
    boot, prefill = free_port(pair=True), free_port(pair=True)
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(
        f'model = "{qwen3_8b}"\nplatform = "cpu"\ntransport = "cma"\nhost = "127.0.0.1"\nhost_ip = "127.0.0.1"\nblock_size = 32\n'
        f"kv_events = false\n[bootstrap]\nport = {boot}\n[[prefill]]\nport = {prefill}\nomp_bind = \"0\"\n"
        f"[[decode]]\nport = {free_port()}\nomp_bind = \"1\"\n[proxy]\nport = {free_port()}\n"
        '[autoscale]\nprofile = "tiny.profile.json"\nttft_ms = 300\nitl_ms = 40\n[autoscale.prefill]\nmin = 1\nmax = 2\n'
    )
    with socket.socket() as held:  # the added prefill's bootstrap: the next free port after the first's
        held.bind(("127.0.0.1", boot + 1))
        held.listen()
        err = preflight_fails(capsys, "-f", str(deploy), "--log-dir", str(tmp_path / "logs"))
    assert (f"bootstrap-1 (an engine [autoscale] may add): port {boot + 1} on 127.0.0.1 (bootstrap, from [bootstrap] port "
            "(the next free port after the bootstrap before)) is held by another process") in err
    assert not (tmp_path / "logs").exists()


def test_preflight_mismatched_block_size(capsys, qwen3_8b: Path, tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(
        f'model = "{qwen3_8b}"\nplatform = "cpu"\nhost = "127.0.0.1"\nhost_ip = "127.0.0.1"\nblock_size = 32\n'
        f"kv_events_port = {free_port()}\n"  # not the default 5557, which a deployment running beside may hold
        f"[bootstrap]\nport = {free_port()}\n[[prefill]]\nport = {free_port()}\n"
        f"[[decode]]\nport = {free_port()}\nblock_size = 64\n[proxy]\nport = {free_port()}\n"
    )
    err = preflight_fails(capsys, "-f", str(deploy), "--log-dir", str(tmp_path / "logs"))
    assert "prefill-0/decode-0: block size differs: P 32, D 64" in err
    # Alone, the fix is the hint line; beside another problem (a port taken on a busy host) it ends the problem's line.
    assert "hint: set the same block_size on both" in err or "P 32, D 64; fix: set the same block_size on both" in err
    assert not (tmp_path / "logs").exists()


def test_preflight_unreachable_bootstrap(capsys, qwen3_8b: Path, tmp_path: Path) -> None:
    closed = free_port()  # nothing listens here
    err = preflight_fails(capsys, "--role", "prefill", "--model", str(qwen3_8b), "--platform", "cpu", "--listen", "127.0.0.1",
                          "--host-ip", "127.0.0.1", "--port", str(free_port()), "--bootstrap", f"http://127.0.0.1:{closed}",
                          "--log-dir", str(tmp_path))
    assert f"bootstrap: http://127.0.0.1:{closed} is unreachable" in err
    assert "hint: start it (pdkv bootstrap --port PORT) or fix the bootstrap URL" in err


def test_preflight_reports_every_problem_one_line_each(capsys, tmp_path: Path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        err = preflight_fails(capsys, "--role", "decode", "--model", str(tmp_path / "no-model"), "--platform", "cpu",
                              "--listen", "127.0.0.1", "--host-ip", "127.0.0.1", "--port", str(port), "--block-size", "16",
                              "--log-dir", str(tmp_path))
    lines = err.strip().splitlines()
    assert lines[0] == "pdkv: error: pre-flight found 3 problems:"
    assert len([line for line in lines if "; fix: " in line]) == 3


def test_ipc_needs_gpus_and_pdkvs_connector(capsys):
    from pdkv.cli import run

    assert run(["up", "--transport", "ipc", "--platform", "cpu", "--dry-run"]) == 2
    assert "between GPUs" in capsys.readouterr().err
    role = ["up", "--role", "prefill", "--model", "m", "--platform", "gpu"]
    assert run([*role, "--transport", "ipc", "--connector", "mooncake", "--dry-run"]) == 2
    assert "pdkv's own transport" in capsys.readouterr().err


def test_ipc_role_dry_run_sets_the_transport_and_both_gpus(capsys):
    import json

    from pdkv.cli import run

    role = ["up", "--role", "prefill", "--model", "m", "--platform", "gpu"]
    code = run([*role, "--transport", "ipc", "--gpu", "0,1", "--host-ip", "127.0.0.1", "--dry-run", "--json"])
    assert code == 0
    part = json.loads(capsys.readouterr().out)["parts"][0]
    config = json.loads(part["argv"][part["argv"].index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"]["mooncake_protocol"] == "ipc"
    assert part["env"]["CUDA_VISIBLE_DEVICES"] == "0,1"


def test_cma_needs_host_memory_and_pdkvs_connector(capsys):
    from pdkv.cli import run

    assert run(["up", "--transport", "cma", "--platform", "gpu", "--dry-run"]) == 2
    assert "host memory" in capsys.readouterr().err
    role = ["up", "--role", "decode", "--model", "m", "--platform", "cpu"]
    assert run([*role, "--transport", "cma", "--connector", "mooncake", "--dry-run"]) == 2
    assert "pdkv's own transport" in capsys.readouterr().err


def test_local_cpu_dry_run_moves_kv_with_cma(capsys):
    import json

    from pdkv.cli import run

    assert run(["up", "--platform", "cpu", "--dry-run", "--json"]) == 0
    parts = [p for p in json.loads(capsys.readouterr().out)["parts"] if "--kv-transfer-config" in p["argv"]]
    assert len(parts) == 2
    for part in parts:
        config = json.loads(part["argv"][part["argv"].index("--kv-transfer-config") + 1])
        assert config["kv_connector_extra_config"]["mooncake_protocol"] == "cma"


def test_preflight_refuses_vllms_connector_on_a_cpu_host(capsys, qwen3_8b: Path, tmp_path: Path) -> None:
    err = preflight_fails(capsys, "--role", "prefill", "--connector", "mooncake", "--model", str(qwen3_8b), "--platform", "cpu",
                          "--listen", "127.0.0.1", "--host-ip", "127.0.0.1", "--port", str(free_port()),
                          "--bootstrap-port", str(free_port()), "--log-dir", str(tmp_path / "logs"))
    lines = err.strip().splitlines()
    assert lines[0].startswith("pdkv: error: pre-flight: prefill: vLLM's MooncakeConnector needs GPU KV caches")
    assert "Cannot access accelerator device when none is available" in lines[0]
    assert lines[1].strip() == 'hint: use --connector pdkv (connector = "pdkv" in deploy.toml)'
    assert not (tmp_path / "logs").exists()


def test_engines_log_through_pdkvs_vllm_logging_unless_the_caller_configures_it(capsys, monkeypatch, tmp_path: Path) -> None:
    parts = dry_run(capsys, "--platform", "cpu", "--log-dir", str(tmp_path))
    want = str(tmp_path.resolve() / "vllm-logging.json")
    assert {p["name"]: p["env"].get("VLLM_LOGGING_CONFIG_PATH") for p in parts} == {
        "bootstrap-0": None, "prefill-0": want, "decode-0": want, "proxy": None}
    assert not list(tmp_path.iterdir())  # a dry run writes nothing
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    assert all("VLLM_LOGGING_CONFIG_PATH" not in p["env"] for p in dry_run(capsys, "--platform", "cpu"))


def test_restart_policy_from_the_file_each_part_and_the_flag(capsys, tmp_path: Path) -> None:
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(
        'model = "/m"\nhost_ip = "10.0.0.5"\nrestart = "no"\n[bootstrap]\nrestart = "on-failure"\n'
        '[[prefill]]\nport = 8100\n[[decode]]\nport = 8200\nrestart = "on-failure"\n[proxy]\nport = 8000\n'
    )
    parts = dry_run(capsys, "-f", str(deploy))
    restarts = {p["name"]: p["restart"] for p in parts}
    assert restarts == {"bootstrap-0": "on-failure", "prefill-0": "no", "decode-0": "on-failure", "proxy": "no"}
    parts = dry_run(capsys, "-f", str(deploy), "--restart", "on-failure")
    assert {p["restart"] for p in parts} == {"on-failure"}
    assert {p["restart"] for p in dry_run(capsys, "--platform", "cpu")} == {"on-failure"}  # the default
    assert run(["up", "--restart", "always", "--dry-run"]) == 2
    assert "--restart 'always' is not one of on-failure, no" in capsys.readouterr().err


def _fleet_file(tmp_path: Path, token: str | None) -> Path:
    f = tmp_path / "deploy.toml"
    key = f'token = "{token}"\n' if token else ""
    f.write_text(f'model = "m"\nplatform = "cpu"\ntransport = "tcp"\nhost = "0.0.0.0"\nhost_ip = "10.0.0.5"\n{key}'
                 "[[prefill]]\nport = 8100\n[[decode]]\nport = 8200\n")
    return f


def test_up_warns_of_side_channels_and_bootstraps_beyond_loopback_without_a_key(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("PDKV_TOKEN", raising=False)
    monkeypatch.delenv("PDKV_BOOTSTRAP_TOKEN", raising=False)
    assert run(["up", "-f", str(_fleet_file(tmp_path, None)), "--dry-run", "--json"]) == 0
    warnings = [json.loads(line)["message"] for line in capsys.readouterr().err.splitlines() if '"warning"' in line]
    assert any("bootstrap-0 listens on 0.0.0.0 with no deployment key" in w for w in warnings), warnings
    assert any("prefill-0's KV side channel listens on 10.0.0.5 with no deployment key" in w for w in warnings), warnings


def test_up_refuses_a_key_under_the_retired_name_and_names_pdkv_token(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("PDKV_TOKEN", raising=False)
    monkeypatch.setenv("PDKV_BOOTSTRAP_TOKEN", "s3cret")
    assert run(["up", "-f", str(_fleet_file(tmp_path, None)), "--dry-run", "--json"]) == 2
    assert "PDKV_BOOTSTRAP_TOKEN is set and PDKV_TOKEN is not" in capsys.readouterr().err


def test_up_hands_the_files_key_to_every_part_through_the_environment_and_prints_it_nowhere(capsys, tmp_path: Path,
                                                                                           monkeypatch) -> None:
    monkeypatch.setenv("PDKV_TOKEN", "")  # so that monkeypatch puts it back as it was once the test is over
    docs = dry_run(capsys, "-f", str(_fleet_file(tmp_path, "s3cret-key")))
    import os

    assert os.environ["PDKV_TOKEN"] == "s3cret-key"  # what every part inherits (ManagedProcess copies os.environ)
    assert "s3cret-key" not in json.dumps(docs)
    assert "warning" not in capsys.readouterr().err


def test_listen_is_the_address_of_an_engine_started_by_role_and_host_is_a_usage_error_there(capsys) -> None:
    (part,) = dry_run(capsys, "--role", "decode", "--model", "m", "--platform", "gpu", "--listen", "127.0.0.2", "--transport", "tcp")
    assert part["argv"][part["argv"].index("--host") + 1] == "127.0.0.2"
    assert run(["up", "--role", "decode", "--model", "m", "--host", "127.0.0.3", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert "--host goes with -f FILE" in err and "--listen" in err
    assert run(["up", "--listen", "127.0.0.1", "--dry-run"]) == 2
    assert "--listen goes with --role" in capsys.readouterr().err


def test_a_file_with_p_and_d_of_different_tp_starts_each_rank_on_its_own_cores(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}))
    (tmp_path / "d.toml").write_text(f"""
model = "{model}"
connector = "pdkv"
transport = "tcp"
platform = "cpu"
host_ip = "127.0.0.1"
block_size = 32
[[prefill]]
port = {free_port()}
omp_bind = "0"
[[decode]]
port = {free_port()}
tp = 2
omp_bind = "0-1"
""")
    parts = {p["name"]: p for p in dry_run(capsys, "-f", str(tmp_path / "d.toml"))}
    d, p = parts["decode-0"], parts["prefill-0"]
    assert d["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1" and d["argv"][d["argv"].index("--tensor-parallel-size") + 1] == "2"
    assert p["env"]["VLLM_CPU_OMP_THREADS_BIND"] == "0" and "--tensor-parallel-size" not in p["argv"]
    # Two ranks on one core: said before anything starts.
    (tmp_path / "d.toml").write_text((tmp_path / "d.toml").read_text().replace('omp_bind = "0-1"', 'omp_bind = "1"'))
    assert run(["up", "-f", str(tmp_path / "d.toml"), "--dry-run"]) == 2
    assert "gives 1 core(s) to 2 TP ranks" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["up", "--dry-run"], ["doctor"], ["bench"], ["bench", "serve"]])
def test_protocol_is_no_option_of_up_doctor_or_bench(capsys, argv: list[str]) -> None:
    assert run([*argv, "--protocol", "tcp"]) == 2
    assert "--protocol" in capsys.readouterr().err
