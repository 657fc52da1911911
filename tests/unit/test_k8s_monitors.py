"""`pdkv.k8s.monitors`: with `monitors = true`, a PodMonitor of the engines and a ServiceMonitor of the proxy and
the bootstrap, valid against schemas written from the Prometheus Operator's CRDs, selecting exactly the pods and
Services that serve /metrics on the named ports, and giving each target the job the shipped rules select on."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from support.k8s_objects import containers, deployment_text, pod_templates, render_text, validate

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"


def _matches(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    return all(labels.get(e["key"]) in e["values"] for e in selector.get("matchExpressions", []))  # operator In only


def _job(relabelings: list[dict], meta: dict[str, str]) -> dict[str, str]:
    """The target labels the relabelings make from discovery's meta labels (replace actions, regex (.*))."""
    out: dict[str, str] = {}
    for r in relabelings:
        assert r["action"] == "replace" and "regex" not in r
        value = ";".join(meta.get(s, "") for s in r["sourceLabels"])
        out[r["targetLabel"]] = r.get("replacement", "$1").replace("$1", value)
    return out


def _meta(kind: str, labels: dict[str, str]) -> dict[str, str]:
    return {f"__meta_kubernetes_{kind}_label_" + re.sub(r"[^a-zA-Z0-9]", "_", k): v for k, v in labels.items()}


@pytest.fixture(scope="module")
def objects(tmp_path_factory) -> list[dict]:
    # TP 16 on nodes of 8 GPUs: P is a LeaderWorkerSet, whose worker pods serve no HTTP port.
    return render_text(tmp_path_factory.mktemp("monitors"), deployment_text(prefill="tp = 16", kubernetes="monitors = true"))


def test_both_monitors_validate_and_a_misspelled_field_does_not(objects) -> None:
    monitors = [o for o in objects if o["kind"] in ("PodMonitor", "ServiceMonitor")]
    assert [o["kind"] for o in monitors] == ["PodMonitor", "ServiceMonitor"]
    for obj in monitors:
        validate(obj, "1.30")
    bad = {**monitors[0], "spec": {**monitors[0]["spec"], "podMetricEndpoints": []}}
    with pytest.raises(jsonschema.ValidationError):
        validate(bad, "1.30")


def test_the_podmonitor_scrapes_each_engine_pod_that_serves_http_as_its_role(objects) -> None:
    (pm,) = [o for o in objects if o["kind"] == "PodMonitor"]
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    jobs = {job["job_name"] for job in yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"]}
    scraped = []
    for obj, kind, template in pod_templates(objects):
        labels = template["metadata"]["labels"]
        ports = {p["name"] for c in containers(template) for p in c.get("ports", [])}
        if _matches(pm["spec"]["selector"], labels) and endpoint["port"] in ports:
            target = _job(endpoint["relabelings"], _meta("pod", labels))
            assert target["job"] in jobs
            scraped.append((obj["kind"], kind, target["job"], target["part"]))
    assert sorted(scraped) == [("Deployment", "pod", "pdkv-decode", "decode-0"), ("LeaderWorkerSet", "leader", "pdkv-prefill", "prefill-0")]
    assert endpoint["path"] == "/metrics"


def test_the_servicemonitor_scrapes_the_proxy_and_the_bootstrap_by_their_port_names(objects) -> None:
    (sm,) = [o for o in objects if o["kind"] == "ServiceMonitor"]
    ports = {e["port"]: e for e in sm["spec"]["endpoints"]}
    scraped = []
    for svc in (o for o in objects if o["kind"] == "Service"):
        labels = svc["metadata"]["labels"]
        if not _matches(sm["spec"]["selector"], labels):
            continue
        for port in svc["spec"]["ports"]:
            if port["name"] in ports:
                scraped.append((_job(ports[port["name"]]["relabelings"], _meta("service", labels))["job"], port["name"]))
    assert sorted(scraped) == [("pdkv-bootstrap", "bootstrap"), ("pdkv-proxy", "http")]


def test_no_monitor_unless_asked(tmp_path) -> None:
    assert not [o for o in render_text(tmp_path, deployment_text()) if o["kind"] in ("PodMonitor", "ServiceMonitor")]
