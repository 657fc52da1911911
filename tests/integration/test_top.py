"""`pdkv top --once` against pdkv's real proxy in front of stub P and D servers (real HTTP on 127.0.0.1)."""

from __future__ import annotations

import json
import threading

import pytest
from support.proxy_stubs import Deployment
from support.waiting import wait_for

from pdkv.cli import run

BODY = {"model": "m", "prompt": "hello", "max_tokens": 4}


def _top(capsys: pytest.CaptureFixture[str], url: str, *extra: str) -> tuple[int, dict]:
    code = run(["top", "--proxy", url, "--once", "--json", *extra])
    return code, json.loads(capsys.readouterr().out)


def test_once_json_shows_engines_and_the_requests_made_between_its_two_readings(capsys) -> None:
    with Deployment() as dep, dep.client() as probe:
        wait_for(lambda: probe.get("/health").status_code == 200, 10, "the proxy to be ready")
        stop = threading.Event()

        def load() -> None:
            with dep.client() as client:
                while not stop.is_set():
                    assert client.post("/v1/completions", json=BODY).status_code == 200

        sender = threading.Thread(target=load, daemon=True)
        sender.start()
        try:
            code, doc = _top(capsys, dep.url, "--interval", "0.5")
        finally:
            stop.set()
            sender.join(timeout=10)
    assert code == 0 and doc["ok"] is True
    assert [(e["name"], e["up"], e["running"]) for e in doc["engines"]] == [("prefill-0", True, 1), ("decode-0", True, 1)]
    assert doc["window_s"] >= 0.5
    serving = doc["serving"]
    assert serving["requests_per_s"] > 0 and serving["requests"] >= 1
    assert serving["ttft_p50_ms"] is not None and serving["ttft_p50_ms"] <= serving["ttft_p90_ms"]
    assert serving["errors"] == 0 and serving["local_fallbacks"] == 0
    assert doc["transfers"]["failures"] == 0 and doc["planner"] is None


def test_once_exits_failed_when_an_engine_is_down_and_names_it(capsys) -> None:
    with Deployment() as dep, dep.client() as probe:
        dep.decodes[0].behaviour["healthy"] = False
        wait_for(lambda: not probe.get("/health").json()["backends"][1]["up"], 10, "the proxy to take D out")
        code, doc = _top(capsys, dep.url, "--interval", "0.2")
        assert code == 1 and doc["ok"] is False
        down = [e for e in doc["engines"] if not e["up"]]
        assert [e["name"] for e in down] == ["decode-0"] and down[0]["reason"]
        code = run(["top", "--proxy", dep.url, "--once", "--interval", "0.2"])
        screen = capsys.readouterr().out
        assert code == 1 and "decode-0" in screen and "down" in screen


def test_an_unreachable_proxy_is_a_failed_view_not_a_traceback(capsys) -> None:
    from support.ports import free_port

    code, doc = _top(capsys, f"http://127.0.0.1:{free_port()}", "--interval", "0.2")
    assert code == 1 and doc["proxy_up"] is False and "unreachable" in doc["proxy_reason"]


def test_json_without_once_is_a_usage_error(capsys) -> None:
    assert run(["top", "--json"]) == 2
