"""`pdkv status` against a real bootstrap server and a real proxy on 127.0.0.1 (engines absent)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pdkv.bootstrap import ProbePolicy
from pdkv.bootstrap.server import make_app
from pdkv.cli import run
from pdkv.service import BackgroundService
from support.ports import free_port


@pytest.fixture
def bootstrap():
    with BackgroundService(make_app(probe=ProbePolicy(interval=0))) as svc:
        body = {"engine_id": "eng-p0", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:5555"}
        httpx.post(f"{svc.url}/register", json=body, timeout=5).raise_for_status()
        yield svc


def test_status_from_a_deploy_file(capsys, bootstrap, tmp_path: Path) -> None:
    p_port, d_port, proxy_port = free_port(), free_port(), free_port()
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(
        f'model = "/m"\nhost = "127.0.0.1"\nhost_ip = "127.0.0.1"\n[bootstrap]\nport = {bootstrap.port}\n'
        f"[[prefill]]\nport = {p_port}\n[[decode]]\nport = {d_port}\n[proxy]\nport = {proxy_port}\n"
    )
    code = run(["status", "-f", str(deploy), "--json", "--timeout", "1"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1 and data["ok"] is False  # only the bootstrap is up
    health = {p["name"]: p["up"] for p in data["parts"]}
    assert health == {"bootstrap-0": True, "prefill-0": False, "decode-0": False, "proxy": False}
    assert data["registrations"] == [
        {"bootstrap": bootstrap.url, "dp_rank": 0, "engine_id": "eng-p0", "tp_rank": 0, "pp_rank": 0, "addr": "tcp://127.0.0.1:5555"}
    ]
    assert data["proxy"] is None


def test_status_discovers_parts_through_the_proxy(capsys, bootstrap) -> None:
    from pdkv.proxy.config import build_config
    from pdkv.proxy.server import BackgroundProxy

    p_url, d_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    config = build_config([f"{p_url},{bootstrap.url}"], [d_url], port=0, health_interval=0.2, health_timeout=0.5)
    with BackgroundProxy(config) as proxy:
        code = run(["status", "--proxy", proxy.url, "--json", "--timeout", "1"])
        data = json.loads(capsys.readouterr().out)
        assert code == 1
        kinds = {(p["kind"], p["url"]): p["up"] for p in data["parts"]}
        assert kinds == {("proxy", proxy.url): False, ("prefill", p_url): False, ("decode", d_url): False}
        assert [r["engine_id"] for r in data["registrations"]] == ["eng-p0"]
        figures = data["proxy"]
        assert figures["url"] == proxy.url and figures["requests"] == 0
        assert figures["in_flight"] == {p_url: 0, d_url: 0}
        assert figures["recent_errors"] == []

        assert run(["status", "--proxy", proxy.url]) == 1
        out = capsys.readouterr().out
        assert "eng-p0" in out and "down" in out and "in flight" in out


def test_status_usage_error(capsys) -> None:
    assert run(["status", "--proxy", "http://127.0.0.1:1", "-f", "x.toml"]) == 2
    assert "either --proxy or -f" in capsys.readouterr().err
