"""`pdkv proxy` as a process: a TOML config, one JSON line when ready, requests served, SIGTERM stops it."""

from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys

import httpx

from pdkv.bootstrap import ProbePolicy, start_background
from pdkv.wire import RegisterRequest

from support.proxy_stubs import REQUEST, Stub


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        assert sel.select(timeout=timeout), f"no output within {timeout} s: {proc.stderr.read() if proc.poll() is not None else ''}"
    return proc.stdout.readline()


def test_cli_serves_from_a_config_file_and_stops_on_sigterm(tmp_path):
    p, d = Stub("p0"), Stub("d0")
    p.service.start()
    d.service.start()
    bootstrap = start_background(probe=ProbePolicy(interval=0))
    try:
        bootstrap.registry.register(RegisterRequest(engine_id="engine-cli", dp_rank=0, tp_rank=0, pp_rank=0,
                                                    addr=f"tcp://127.0.0.1:{p.service.port}"))
        config = tmp_path / "proxy.toml"
        config.write_text(f'prefill = ["{p.url},{bootstrap.url}"]\ndecode = ["{d.url}"]\nport = 0\n'
                          'policy = "least-outstanding"\nhealth-interval = 0.2\n')
        proc = subprocess.Popen([sys.executable, "-m", "pdkv", "proxy", "--config", str(config), "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            ready = json.loads(_read_line(proc, 20))
            assert ready["ready"] is True and ready["policy"] == "least-outstanding"
            assert ready["backends"][0]["engines"] == {"0": "engine-cli"}
            r = httpx.post(f"{ready['url']}/v1/completions", json=REQUEST, timeout=10, trust_env=False)
            assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
            proc.stderr.close()
    finally:
        bootstrap.stop()
        p.service.stop()
        d.service.stop()


def test_cli_refuses_a_missing_decode_with_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "pdkv", "proxy", "--prefill", "http://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2
    assert "no decode server given" in proc.stderr and "hint:" in proc.stderr
