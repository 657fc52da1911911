"""The planner's live signal in a real proxy (stub P and D servers, a real bootstrap): what it observes from the
requests it serves and P's /metrics, the gauges on /metrics, GET /pdkv/planner; and POST /pdkv/drain."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from support.planner_profiles import write_profile
from support.proxy_stubs import REQUEST, Deployment
from support.waiting import wait_for

# 10 ms + 0.1 ms a token: a 100-token prompt is 20 ms alone, far under the 150 ms target at a few requests a second.
PROFILE = ((10.0, 0.0, 0.1, 0.0), (5.0, 0.1, 0.0))


def planner(profile: Path, **kw) -> dict:
    return {"profile": str(profile), "ttft_ms": 150, "itl_ms": 500, "interval_s": 0.1, "window_s": 8, "max_prefill": 3,
            "up_after_s": 0, "down_after_s": 0.5, **kw}


@pytest.fixture
def dep(tmp_path: Path) -> Iterator[Deployment]:
    profile = write_profile(tmp_path / "p.json", *PROFILE)
    with Deployment(n_prefill=2, planner=planner(profile)) as d:
        for s in d.prefills:
            s.behaviour["prompt_tokens"] = 100
        yield d


def gauges(c: httpx.Client) -> dict[tuple[str, str], float]:
    out = {}
    for family in text_string_to_metric_families(c.get("/metrics").text):
        for s in family.samples:
            if s.name.startswith("pdkv_planner_"):
                out[(s.name, next(iter(s.labels.values()), ""))] = s.value
    return out


def test_a_slow_prefill_raises_the_desired_count_and_the_gauges_show_it(dep: Deployment) -> None:
    with dep.client() as c:
        wait_for(lambda: c.get("/pdkv/planner").json().get("desired") is not None, what="the planner's first round")
        first = c.get("/pdkv/planner").json()
        assert first["desired"] == {"prefill": 2, "decode": 1} and first["current"] == {"prefill": 2, "decode": 1}
        assert gauges(c)[("pdkv_planner_current_engines", "prefill")] == 2
        for s in dep.prefills:
            s.behaviour.update(waiting=2)  # P's queue, as its /metrics shows it
        dep.decodes[0].behaviour["delay"] = 0.3  # D's first byte, the TTFT: over the 150 ms target
        for _ in range(4):
            assert c.post("/v1/completions", json=REQUEST).status_code == 200
        # A round after the fourth request's answer (the view is the last round's, up to interval_s old).
        wait_for(lambda: (v := c.get("/pdkv/planner").json())["desired"]["prefill"] == 3 and v["observation"]["requests"] == 4,
                 what="a third prefill engine asked for, from the four requests")
        view = c.get("/pdkv/planner").json()
        obs = view["observation"]
        assert obs["requests"] == 4 and obs["mean_prompt_tokens"] == 100 and obs["ttft_ms"] >= 300
        assert obs["prefill_waiting"] == 4 and obs["prefill_running"] == 2  # both P's /metrics, summed
        assert obs["mean_output_tokens"] == 3  # the stub streams 3 events before [DONE]
        assert view["binding"] in ("ttft", "itl") and view["bounds"]["prefill"] == [1, 3]
        g = gauges(c)
        assert g[("pdkv_planner_desired_engines", "prefill")] == 3 and g[("pdkv_planner_desired_engines", "decode")] == 1
        assert g[("pdkv_planner_binding_slo", view["binding"])] == 1
        assert g[("pdkv_planner_predicted_seconds", "ttft")] > 0
        # The window passes with no request: the count falls back (after down_after_s) to the minimum.
        for s in dep.prefills:
            s.behaviour.update(waiting=0)
        wait_for(lambda: c.get("/pdkv/planner").json()["desired"]["prefill"] == 1, timeout=20, what="the count let go")


def test_a_draining_prefill_gets_no_new_request_and_its_requests_in_flight_finish(dep: Deployment) -> None:
    p0, p1 = dep.prefills
    d = dep.decodes[0]
    d.behaviour["delay"] = 1.0  # each request in flight (P to D's last byte) for a second
    with dep.client() as c:
        wait_for(lambda: c.get("/pdkv/planner").json().get("desired") is not None, what="the planner's first round")
        done: list[int] = []
        slow = [threading.Thread(target=lambda: done.append(c.post("/v1/completions", json=REQUEST).status_code)) for _ in range(2)]
        for t in slow:
            t.start()
        wait_for(lambda: len(p1.seen) == 1, what="one request on p1")  # round-robin: one each
        r = c.post("/pdkv/drain", json={"url": p1.url})
        assert r.status_code == 200 and r.json() == {"url": p1.url, "role": "prefill", "draining": True, "in_flight": 1}
        assert c.get("/pdkv/planner").json()["backends"][1] == {"role": "prefill", "url": p1.url, "up": True, "draining": True,
                                                                "in_flight": 1}
        d.behaviour["delay"] = 0.0
        for _ in range(4):
            assert c.post("/v1/completions", json=REQUEST).status_code == 200
        assert len(p1.seen) == 1 and len(p0.seen) == 5
        for t in slow:
            t.join(timeout=10)
        assert done == [200, 200]  # the one in flight on the draining P finished
        assert c.post("/pdkv/drain", json={"url": p1.url}).json()["in_flight"] == 0
        wait_for(lambda: c.get("/pdkv/planner").json()["current"]["prefill"] == 1, what="the draining P no longer counted")
        assert c.post("/pdkv/drain", json={"url": p1.url, "draining": False}).json()["draining"] is False
        for _ in range(2):
            assert c.post("/v1/completions", json=REQUEST).status_code == 200
        assert len(p1.seen) == 2


def test_drain_and_planner_refuse_what_they_cannot_do(tmp_path: Path) -> None:
    with Deployment() as d, d.client() as c:  # the planner is off
        assert c.get("/pdkv/planner").status_code == 404
        assert "--planner-profile" in c.get("/pdkv/planner").json()["error"]["message"]
        assert c.post("/pdkv/drain", json={"url": "http://127.0.0.1:1"}).status_code == 404
        assert c.post("/pdkv/drain", content=b"{}").status_code == 400
        assert c.post("/pdkv/drain", json={"url": "ftp://x"}).status_code == 400
        assert c.get("/pdkv/drain").status_code == 405
        assert c.post("/pdkv/planner").status_code == 405
        assert c.get("/pdkv/nothing").status_code == 404
