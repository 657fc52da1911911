"""The proxy's, the bootstrap's and the connector's metrics text, read back with prometheus_client's parser.

BEFORE was written down from the hand-written exposition these replaced (the
same observations as `_rendered` makes), as the parser names the families.
prometheus_client adds one `<family>_created` gauge per counter and histogram
(unix time it was made); nothing else may appear, vanish or change its labels.
"""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdkv.metrics import BUCKETS_S

T0 = 1796000000.0
PROXY_BACKENDS = [{"role": "decode", "url": "http://d:1"}, {"role": "prefill", "url": "http://p:1"}]
HISTOGRAM = {"_bucket": [{}], "_count": [{}], "_sum": [{}]}
PREFILL = {"role": "prefill"}
CONNECTOR_HISTOGRAM = {"_bucket": [PREFILL], "_count": [PREFILL], "_sum": [PREFILL]}
CAUSES = ("bad_request", "client_disconnect", "decode_connect", "decode_disconnect", "decode_status", "decode_timeout",
          "no_backend", "prefill_connect", "prefill_disconnect", "prefill_status", "prefill_timeout")  # fmt: skip

# family -> (type, help, {sample name suffix: [labels of each sample, "le" left out]})
BEFORE = {
    "proxy": {
        "pdkv_proxy_requests": ("counter", "Requests answered, by HTTP status.", {"_total": [{"status": "200"}, {"status": "502"}]}),
        "pdkv_proxy_errors": ("counter", "Failed requests, by cause.", {"_total": [{"cause": c} for c in CAUSES]}),
        "pdkv_proxy_local_prefill": (
            "counter", "Requests decode computed alone, by reason.", {"_total": [{"reason": "no_prefill"}, {"reason": "prefill_failed"}]}
        ),
        "pdkv_proxy_prefill_seconds": ("histogram", "P dispatched to P's answer.", HISTOGRAM),
        "pdkv_proxy_decode_wait_seconds": ("histogram", "P's answer to D's first byte.", HISTOGRAM),
        "pdkv_proxy_ttfb_seconds": ("histogram", "Proxy received to first byte sent to the client.", HISTOGRAM),
        "pdkv_proxy_request_seconds": ("histogram", "Proxy received to last byte sent to the client.", HISTOGRAM),
        "pdkv_proxy_backend_up": ("gauge", "1 if the backend passes health checks.", {"": PROXY_BACKENDS}),
        # Renamed from pdkv_proxy_outstanding: a count of requests names its unit.
        "pdkv_proxy_outstanding_requests": ("gauge", "Requests in flight per backend.", {"": PROXY_BACKENDS}),
    },
    "connector": {
        "pdkv_connector_transfers": (
            "counter", "Transfers by outcome.", {"_total": [{"outcome": "expired", **PREFILL}, {"outcome": "sent", **PREFILL}]}
        ),
        "pdkv_connector_bytes": ("counter", "KV bytes written to decode engines.", {"_total": [PREFILL]}),
        "pdkv_connector_descriptors": ("counter", "Write descriptors issued.", {"_total": [PREFILL]}),
        "pdkv_connector_malformed": ("counter", "Side-channel messages refused as malformed.", {"_total": [PREFILL]}),
        "pdkv_connector_auth_refused": (
            "counter", "Side-channel frames dropped for their seal (deployment key set).",
            {"_total": [{"reason": "replayed", **PREFILL}, {"reason": "unauthenticated", **PREFILL}]},
        ),
        "pdkv_connector_transfer_seconds": ("histogram", "Duration of one KV write.", CONNECTOR_HISTOGRAM),
        "pdkv_connector_handover_seconds": ("histogram", "P prefill done to D first token scheduled.", CONNECTOR_HISTOGRAM),
    },
    "bootstrap": {
        "pdkv_bootstrap_registrations": (
            "counter", "Accepted POST /register calls, by result.",
            {"_total": [{"result": "created"}, {"result": "replaced"}, {"result": "unchanged"}]},
        ),
        "pdkv_bootstrap_rejects": (
            "counter", "Refused POST /register and /deregister calls, by reason.",
            {"_total": [{"reason": "conflict"}, {"reason": "invalid"}, {"reason": "unauthorized"}]},
        ),
        "pdkv_bootstrap_queries": ("counter", "GET /query calls answered.", {"_total": [{}]}),
        "pdkv_bootstrap_deregistrations": ("counter", "POST /deregister calls accepted.", {"_total": [{}]}),
        "pdkv_bootstrap_evictions": ("counter", "Engines dropped by the liveness sweep.", {"_total": [{}]}),
        "pdkv_bootstrap_engines": ("gauge", "DP ranks with a registered engine.", {"": [{}]}),
        "pdkv_bootstrap_workers": ("gauge", "Registered worker addresses.", {"": [{}]}),
        # Added with the members registry:
        "pdkv_bootstrap_members": ("gauge", "Live members (engines with an unexpired lease).", {"": [{}]}),
        "pdkv_bootstrap_member_changes": (
            "counter", "Members that joined, left or expired.",
            {"_total": [{"change": "changed"}, {"change": "expired"}, {"change": "joined"}, {"change": "left"}]},
        ),
    },
}
# The bucket bounds before: the proxy's were BUCKETS_S; the connector's lacked 0.0005, 60 and 120, which one tuple for
# every histogram now gives it.
CONNECTOR_BOUNDS_BEFORE = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _rendered(component: str) -> str:
    if component == "proxy":
        from pdkv.proxy_api import ProxyTiming
        from pdkv.proxy.metrics import ProxyMetrics

        m = ProxyMetrics()
        base = {"endpoint": "/v1/completions", "received": T0}
        m.observe(ProxyTiming(request_id="a", transfer_id="xfer-a", **base, prefill_dispatched=T0 + 0.001, prefill_responded=T0 + 0.01,
                              decode_first_byte=T0 + 0.02, last_byte=T0 + 0.5, status=200))  # fmt: skip
        m.observe(ProxyTiming(request_id="b", transfer_id="xfer-b", **base, status=502, error="prefill_timeout"))
        m.observe(ProxyTiming(request_id="c", transfer_id="xfer-c", **base, status=200, local_prefill="no_prefill",
                              decode_first_byte=T0 + 0.02, last_byte=T0 + 0.5))  # fmt: skip
        return m.render([("prefill", "http://p:1", True, 0), ("decode", "http://d:1", False, 2)])
    if component == "connector":
        from pdkv.connector.timing import TraceLog

        log = TraceLog("prefill")
        log.event("x1", "transfer_start", T0)
        log.event("x1", "transfer_end", T0 + 0.003)
        log.event("x1", "p_finished", T0)
        log.finish("x1", "sent", nbytes=100, descriptors=2)
        log.finish("x2", "expired")
        log.merge("x1", {"first_token_scheduled": T0 + 0.05})
        log.malformed()
        log.auth_refused("unauthenticated")
        log.auth_refused("replayed")
        return log.render_metrics()
    from pdkv.bootstrap.registry import BootstrapRegistry
    from pdkv.bootstrap.server import BootstrapMetrics

    from pdkv.bootstrap.members import MemberTable

    return BootstrapMetrics(BootstrapRegistry(), MemberTable()).render()


def _key(labels: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in labels.items() if k != "le"))


@pytest.mark.parametrize("component", sorted(BEFORE))
def test_same_families_help_and_label_sets_as_before(component):
    families = {f.name: f for f in text_string_to_metric_families(_rendered(component))}
    before = BEFORE[component]
    made = {f"{name}_created" for name, (kind, _, _) in before.items() if kind in ("counter", "histogram")}
    assert set(families) == set(before) | made
    for name in made:
        assert families[name].type == "gauge"
    for name, (kind, help_, samples) in before.items():
        family = families[name]
        assert (family.type, family.documentation) == (kind, help_), name
        seen: dict[str, set] = {}
        for s in family.samples:
            seen.setdefault(s.name.removeprefix(name), set()).add(_key(s.labels))
        assert seen == {suffix: {_key(labels) for labels in each} for suffix, each in samples.items()}, name


@pytest.mark.parametrize("component", ["proxy", "connector"])
def test_every_histogram_has_the_one_bucket_tuple(component):
    for family in text_string_to_metric_families(_rendered(component)):
        if family.type == "histogram":
            bounds = sorted(float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket"))
            assert bounds == [*BUCKETS_S, float("inf")], family.name
    assert set(CONNECTOR_BOUNDS_BEFORE) < set(BUCKETS_S)


def test_counts_and_sums_are_what_was_observed():
    families = {f.name: f for f in text_string_to_metric_families(_rendered("connector"))}
    values = {(s.name, s.labels.get("le", s.labels.get("outcome", ""))): s.value for f in families.values() for s in f.samples}
    assert values[("pdkv_connector_transfers_total", "sent")] == 1
    assert values[("pdkv_connector_bytes_total", "")] == 100
    assert values[("pdkv_connector_malformed_total", "")] == 1
    assert values[("pdkv_connector_transfer_seconds_bucket", "0.0025")] == 0
    assert values[("pdkv_connector_transfer_seconds_bucket", "0.005")] == 1
    assert values[("pdkv_connector_handover_seconds_sum", "")] == pytest.approx(0.05)


def test_malformed_messages_are_counted():
    from pdkv.connector.timing import TraceLog

    log = TraceLog("prefill")
    log.malformed()
    log.malformed()  # as pdkv/connector/sender.py counts a refused pull
    assert log.malformed_total == 2
    assert 'pdkv_connector_malformed_total{role="prefill"} 2.0\n' in log.render_metrics()
