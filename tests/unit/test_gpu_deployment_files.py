"""The GPU tier's deployment files (tests/gpu/deployments.py) load and plan here, in both engine modes: a mistake
in them would otherwise first show on a lent GPU machine."""

from __future__ import annotations

import json

import pytest

from gpu.deployments import GRAPH_ARGS, NAMES, PORTS, deployment_toml
from pdkv.deploy import deployment_parts
from pdkv.deploy.plan.loader import load_deployment


@pytest.mark.parametrize("graphs", sorted(GRAPH_ARGS))
@pytest.mark.parametrize("name", NAMES)
def test_each_file_loads_and_its_engines_share_gpu_0(tmp_path, name: str, graphs: str) -> None:
    path = tmp_path / f"{name}.toml"
    path.write_text(deployment_toml(name, "/models/qwen3-8b", graphs))
    parts = deployment_parts(load_deployment(path))
    engines = [p for p in parts if p.kind in ("prefill", "decode")]
    assert [p.spec.port for p in engines] == [PORTS[name].prefill, PORTS[name].decode]
    for part in engines:
        argv = part.launch.argv
        assert part.launch.env["CUDA_VISIBLE_DEVICES"] == "0" and part.launch.env["VLLM_BATCH_INVARIANT"] == "1"
        if graphs == "eager":
            assert "--enforce-eager" in argv and "--compilation-config" not in argv
        else:
            assert "--enforce-eager" not in argv
            config = json.loads(argv[argv.index("--compilation-config") + 1])
            assert config == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}


@pytest.mark.parametrize("scheduling", ["async", "sync"])
def test_decode_scheduling_changes_d_alone(tmp_path, monkeypatch, scheduling: str) -> None:
    import gpu.deployments as deployments

    monkeypatch.setattr(deployments, "DECODE_SCHEDULING", scheduling)
    path = tmp_path / "pdkv-ipc.toml"
    path.write_text(deployment_toml("pdkv-ipc", "/models/qwen3-8b"))
    argv = {p.kind: p.launch.argv for p in deployment_parts(load_deployment(path)) if p.kind in ("prefill", "decode")}
    assert "--no-async-scheduling" not in argv["prefill"]
    assert ("--no-async-scheduling" in argv["decode"]) == (scheduling == "sync")
    monkeypatch.setattr(deployments, "DECODE_SCHEDULING", "synch")
    with pytest.raises(ValueError, match="async or sync"):
        deployment_toml("pdkv-ipc", "/models/qwen3-8b")


def test_the_layered_socket_deployment_is_the_socket_one_with_p_writing_layer_by_layer(tmp_path) -> None:
    def extra(name: str) -> dict[str, dict]:
        path = tmp_path / f"{name}.toml"
        path.write_text(deployment_toml(name, "/models/qwen3-8b"))
        out = {}
        for part in deployment_parts(load_deployment(path)):
            if part.kind in ("prefill", "decode"):
                argv = part.launch.argv
                config = json.loads(argv[argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
                ports = ("side_channel_port", "socket_port", "bootstrap_server_address")  # each deployment its own
                out[part.kind] = {k: v for k, v in config.items() if k not in ports}
        return out

    one_write, layered = extra("pdkv-socket"), extra("pdkv-socket-layers")
    assert layered["prefill"] == {**one_write["prefill"], "socket_write_layers": True, "socket_layer_groups": 6}
    assert layered["decode"] == one_write["decode"] and one_write["prefill"]["socket_write_layers"] is False


def test_the_socket_deployments_take_the_hosts_measured_settings(tmp_path, monkeypatch) -> None:
    import gpu.deployments as deployments

    monkeypatch.setattr(deployments, "SOCKET_CONNECTIONS", 8)
    monkeypatch.setattr(deployments, "SOCKET_BUFFER", "1048576")
    for name in ("pdkv-socket", "pdkv-socket-layers"):
        path = tmp_path / f"{name}.toml"
        path.write_text(deployment_toml(name, "/models/qwen3-8b"))
        extra = {p.kind: json.loads(p.launch.argv[p.launch.argv.index("--kv-transfer-config") + 1])["kv_connector_extra_config"]
                 for p in deployment_parts(load_deployment(path)) if p.kind in ("prefill", "decode")}
        assert extra["prefill"]["socket_connections"] == 8
        assert extra["prefill"]["socket_buffer_bytes"] == extra["decode"]["socket_buffer_bytes"] == 1 << 20
        assert extra["prefill"].get("socket_layer_groups") == (None if name == "pdkv-socket" else 6)
    monkeypatch.setattr(deployments, "SOCKET_LAYER_GROUPS", "36")  # one write a layer of Qwen3-8B
    path.write_text(deployment_toml("pdkv-socket-layers", "/models/qwen3-8b"))
    prefill = next(p for p in deployment_parts(load_deployment(path)) if p.kind == "prefill")
    assert json.loads(prefill.launch.argv[prefill.launch.argv.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"]["socket_layer_groups"] == 36
    assert "socket_send_process" not in json.loads(prefill.launch.argv[prefill.launch.argv.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"]  # unset: the connector's default
    monkeypatch.setattr(deployments, "SOCKET_SEND_PROCESS", "false")  # P's own threads write, to compare
    path.write_text(deployment_toml("pdkv-socket-layers", "/models/qwen3-8b"))
    prefill = next(p for p in deployment_parts(load_deployment(path)) if p.kind == "prefill")
    assert json.loads(prefill.launch.argv[prefill.launch.argv.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"]["socket_send_process"] is False
    path = tmp_path / "pdkv-tcp.toml"
    path.write_text(deployment_toml("pdkv-tcp", "/models/qwen3-8b"))  # other transports: no socket keys
    assert all("socket_connections" not in " ".join(p.launch.argv) for p in deployment_parts(load_deployment(path)))
