from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys

import httpx
import pytest

from pdkv.bootstrap import BootstrapClient, ProbePolicy, start_background
from pdkv.cli import run
from pdkv.wire import RegisterRequest
from support.ports import free_port

NO_SWEEP = ProbePolicy(interval=0)


@contextlib.contextmanager
def cli_server(*args: str, env: dict[str, str] | None = None):
    """`pdkv bootstrap ... --json` in a child process; yields (process, its ready line)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdkv", "bootstrap", *args, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    try:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        ready = sel.select(timeout=15)
        sel.close()
        assert ready, "pdkv bootstrap printed nothing within 15 s"
        line = proc.stdout.readline()
        assert line, f"pdkv bootstrap exited: {proc.wait(5)} {proc.stderr.read()}"
        yield proc, json.loads(line)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()


def test_help_has_examples(capsys):
    assert run(["bootstrap", "--help"]) == 0
    out = capsys.readouterr().out
    assert "Examples" in out and "pdkv bootstrap query" in out
    assert run(["bootstrap", "query", "--help"]) == 0
    assert "Examples" in capsys.readouterr().out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_serves_until_a_signal_then_exits_cleanly(sig):
    with cli_server("--port", "0", "--probe-interval", "0") as (proc, ready):
        assert ready["url"] == f"http://127.0.0.1:{ready['port']}" and ready["token"] is False
        with BootstrapClient(ready["url"]) as client:
            client.register(RegisterRequest("eng-a", 0, 0, 0, "tcp://127.0.0.1:6000"))
            assert client.query()[0].engine_id == "eng-a"
        proc.send_signal(sig)
        assert proc.wait(timeout=10) == 0
        assert "registered engine 'eng-a'" in proc.stderr.read()


def test_port_comes_from_vllms_env_var_and_token_from_pdkv_env():
    port = free_port()
    env = {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(port), "PDKV_TOKEN": "s3cret"}
    with cli_server("--probe-interval", "0", env=env) as (proc, ready):
        assert ready["port"] == port and ready["token"] is True
        r = httpx.post(f"{ready['url']}/register", json={"engine_id": "e", "dp_rank": 0, "tp_rank": 0, "pp_rank": 0, "addr": "tcp://h:1"})
        assert r.status_code == 401
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0


def test_taken_port_is_exit_3_with_one_line(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        code = run(["bootstrap", "--port", str(taken.getsockname()[1]), "--json"])
    err = capsys.readouterr().err
    assert code == 3
    assert err.startswith("pdkv: error: cannot listen on 127.0.0.1:") and "Traceback" not in err


def test_bad_port_is_a_usage_error(capsys):
    assert run(["bootstrap", "--port", "70000"]) == 2


def test_query_prints_a_table_and_json(capsys):
    with start_background(probe=NO_SWEEP) as svc, BootstrapClient(svc.url) as client:
        assert run(["bootstrap", "query", svc.url]) == 0
        assert "no prefill engine is registered" in capsys.readouterr().out
        client.register(RegisterRequest("eng-a", 0, 0, 0, "tcp://127.0.0.1:6000"))
        client.register(RegisterRequest("eng-a", 0, 1, 0, "tcp://127.0.0.1:6001"))
        assert run(["bootstrap", "query", svc.url]) == 0
        out = capsys.readouterr().out
        assert "eng-a" in out and "tcp://127.0.0.1:6001" in out
        assert run(["bootstrap", "query", svc.url, "--json"]) == 0
        data = json.loads(capsys.readouterr().out)
    assert data == {"0": {"engine_id": "eng-a", "worker_addr": {"0": {"0": "tcp://127.0.0.1:6000"}, "1": {"0": "tcp://127.0.0.1:6001"}}}}


def test_query_default_url_follows_the_port_env(capsys, monkeypatch):
    with start_background(probe=NO_SWEEP) as svc:
        monkeypatch.setenv("VLLM_MOONCAKE_BOOTSTRAP_PORT", str(svc.port))
        assert run(["bootstrap", "query", "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == {}


def test_unreachable_server_is_one_line_naming_it(capsys):
    port = free_port()
    code = run(["bootstrap", "query", f"127.0.0.1:{port}", "--retries", "1", "--timeout", "0.5"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith(f"pdkv: error: bootstrap at http://127.0.0.1:{port} did not answer GET /query after 2 attempts")
    assert "hint:" in err and "Traceback" not in err


def test_deregister_needs_the_token_and_frees_the_rank(capsys, monkeypatch):
    with start_background(token="s3cret", probe=NO_SWEEP) as svc:
        with BootstrapClient(svc.url, token="s3cret") as client:
            client.register(RegisterRequest("eng-a", 0, 0, 0, "tcp://127.0.0.1:6000"))
        assert run(["bootstrap", "deregister", "eng-a", "--url", svc.url]) == 1
        err = capsys.readouterr().err
        assert "(401)" in err and "PDKV_TOKEN" in err
        monkeypatch.setenv("PDKV_BOOTSTRAP_TOKEN", "s3cret")
        assert run(["bootstrap", "deregister", "eng-a", "--url", svc.url]) == 2
        assert "PDKV_BOOTSTRAP_TOKEN is set and PDKV_TOKEN is not" in capsys.readouterr().err
        monkeypatch.setenv("PDKV_TOKEN", "s3cret")
        assert run(["bootstrap", "deregister", "eng-a", "--url", svc.url, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["removed"] == 1
        assert run(["bootstrap", "deregister", "eng-a", "--url", svc.url]) == 0
        assert "nothing removed" in capsys.readouterr().out
        assert svc.registry.query() == {}
