"""The side-channel attack against real vLLM engines running pdkv's connector with the deployment key set.

A 1P1D pair over Mooncake tcp with PDKV_TOKEN in both engines' environment. P
holds a prompt's KV for a transfer bound to D (a request sent to P as the
proxy would, the binding's commitment in its kv_transfer_params); a stranger
process (tests/integration/stranger.py) that knows the transfer id and P's
side-channel address asks for it into memory of its own, first without the
key, then with it but without the binding. P sends it nothing and logs the
refusal; then the real D, with the binding, gets the KV and answers what it
answers computing the prompt itself. Requests through the proxy (which seals
its own side-channel messages with the key from this process's environment)
still answer.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdkv.auth import new_binding
from pdkv.deploy.plan.engine import engine_launch
from pdkv.deploy.run.process import ManagedProcess
from support.engines import PDKV_EXTRA, START_S, answer, body, complete, prompt_ids, spec
from support.ports import free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STRANGER = ROOT / "tests" / "integration" / "stranger.py"
KEY = secrets.token_hex(32)


@pytest.fixture(scope="module")
def keyed_pair(tiny_model: Path, tmp_path_factory) -> Iterator[dict]:
    logs = tmp_path_factory.mktemp("pd-keyed")
    bport = free_port()
    env = {"PDKV_TOKEN": KEY}
    p_spec = spec(tiny_model, "prefill", "pdkv", "0", "tcp", bootstrap_port=bport, extra_env=env, connector_extra=PDKV_EXTRA)
    d_spec = spec(tiny_model, "decode", "pdkv", "1", "tcp", extra_env=env, connector_extra=PDKV_EXTRA, load_failure="fail")
    p = ManagedProcess(engine_launch(p_spec, name="p-keyed"), logs / "p.log").start()
    d = ManagedProcess(engine_launch(d_spec, name="d-keyed"), logs / "d.log").start()
    old = os.environ.get("PDKV_TOKEN")
    os.environ["PDKV_TOKEN"] = KEY  # the proxy below, and the bootstrap registration check, run in this process
    try:
        p.wait_healthy(START_S)
        d.wait_healthy(START_S)
        burl = f"http://127.0.0.1:{bport}"
        query = httpx.get(f"{burl}/query", timeout=5).json()
        from pdkv.proxy.config import PrefillSpec, ProxyConfig
        from pdkv.proxy.server import BackgroundProxy

        with BackgroundProxy(ProxyConfig(prefill=(PrefillSpec(p.url, burl),), decode=(d.url,), port=0)) as proxy:
            yield {"p": p, "d": d, "bootstrap": burl, "engine_id": query["0"]["engine_id"],
                   "side_channel": query["0"]["worker_addr"]["0"]["0"], "proxy": proxy.url, "model": str(tiny_model)}
    except BaseException:
        for e in (p, d):
            print(f"--- {e.name} log tail ---\n{e.log_tail(80)}")
        raise
    finally:
        if old is None:
            os.environ.pop("PDKV_TOKEN", None)
        else:
            os.environ["PDKV_TOKEN"] = old
        p.stop(grace=15)
        d.stop(grace=15)


def stranger(addr: str, tid: str, mode: str, env: dict[str, str] | None = None) -> dict:
    out = subprocess.run([sys.executable, str(STRANGER), addr, tid, mode], check=False, capture_output=True, text=True, timeout=90,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", **(env or {})})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_stranger_gets_nothing_from_a_keyed_p_and_d_still_gets_the_right_answer(keyed_pair: dict, tiny_model: Path) -> None:
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    ids = prompt_ids(200, vocab, seed=4242)
    model = keyed_pair["model"]
    local = answer(complete(keyed_pair["d"].url, body(model, ids)))  # D computing the prompt itself
    tid = f"xfer-{secrets.token_hex(16)}"
    secret, commitment = new_binding()
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, "transfer_id": tid, "decode_binding": commitment}
    r = complete(keyed_pair["p"].url, {**body(model, ids, max_tokens=1, min_tokens=1), "kv_transfer_params": p_params})
    assert r.status_code == 200, r.text[:300]
    time.sleep(0.5)  # P holds the KV now, for up to expiry_s, waiting for its D

    # The stranger's memory is shaped as D's (its log says how), so only the guards can stop it.
    m = re.search(r"pdkv: (\d+) KV regions of \d+ blocks x (\d+) B", keyed_pair["d"].log_tail(2000))
    assert m is not None, "D's log does not give its KV layout"
    layout = {"STRANGER_LAYOUT": f"{m.group(1)},{m.group(2)}"}
    plain = stranger(keyed_pair["side_channel"], tid, "plain", env=layout)
    assert plain == {"replies": [], "written": 0}
    keyed = stranger(keyed_pair["side_channel"], tid, "keyed", env={"PDKV_TOKEN": KEY, **layout})
    assert keyed["written"] == 0 and any("binding" in x for x in keyed["replies"]), keyed
    assert "dropped a frame from 127.0.0.1: unauthenticated" in keyed_pair["p"].log_tail(400)

    d_params = {"do_remote_decode": False, "do_remote_prefill": True, "remote_bootstrap_addr": keyed_pair["bootstrap"],
                "remote_engine_id": keyed_pair["engine_id"], "transfer_id": tid, "binding": secret}
    got = answer(complete(keyed_pair["d"].url, {**body(model, ids), "kv_transfer_params": d_params}))
    assert got[0] == local[0]

    # The whole path through the proxy, every side-channel frame sealed.
    via = complete(keyed_pair["proxy"], body(model, ids), headers={"X-Request-Id": f"keyed-{time.time_ns()}"})
    assert answer(via)[0] == local[0]
