"""`pdkv status`: the health of each part, the bootstrap registrations and the proxy's figures."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from pdkv.deploy.schema import Deployment
from pdkv.deploy.topology import deployment_parts


class PartHealth(msgspec.Struct, frozen=True):
    name: str
    kind: str
    url: str
    up: bool
    detail: str = ""
    host: str = ""  # its [[hosts]] name in a fleet


class Registration(msgspec.Struct, frozen=True):
    bootstrap: str
    dp_rank: int
    engine_id: str
    tp_rank: int
    pp_rank: int
    addr: str


class ProxyFigures(msgspec.Struct, frozen=True):
    url: str
    in_flight: dict[str, int]
    requests: int
    errors: dict[str, int]
    recent_errors: list[dict[str, Any]]


class StatusReport(msgspec.Struct, frozen=True):
    parts: list[PartHealth]
    registrations: list[Registration]
    proxy: ProxyFigures | None

    @property
    def ok(self) -> bool:
        return all(p.up for p in self.parts)


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus text exposition, by prometheus_client's parser.

    Text the parser cannot read ends the list there: the metric families before it are kept.
    """
    from prometheus_client.parser import text_string_to_metric_families

    out: list[tuple[str, dict[str, str], float]] = []
    try:
        for family in text_string_to_metric_families(text):
            out.extend((s.name, dict(s.labels), float(s.value)) for s in family.samples)
    except ValueError:
        pass
    return out


def _get(client: Any, url: str, headers: dict[str, str] | None = None) -> tuple[int | None, Any, str]:
    """(status, parsed JSON or text, error) of GET url; status None when unreachable."""
    import httpx

    try:
        r = client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        return None, None, f"unreachable ({type(exc).__name__})"
    try:
        body = r.json()
    except ValueError:
        body = r.text
    return r.status_code, body, ""


def status_targets(dep: Deployment) -> tuple[list[tuple[str, str, str]], list[str], str | None]:
    """(parts as (name, kind, url), bootstrap URLs, proxy URL) that `pdkv status -f` polls."""
    parts = deployment_parts(dep)
    targets = [(p.plan.name, p.kind, p.plan.url) for p in parts]
    boots = sorted({p.bootstrap_url for p in parts if p.bootstrap_url})
    proxy = next((p.plan.url for p in parts if p.kind == "proxy"), None)
    return targets, boots, proxy


def part_hosts(dep: Deployment) -> dict[str, str]:
    """Part name -> its [[hosts]] name, for a fleet file (empty for one host)."""
    return {p.plan.name: p.host for p in deployment_parts(dep) if p.host}


def collect_status(
    *, proxy_url: str | None = None, targets: Sequence[tuple[str, str, str]] = (), bootstraps: Sequence[str] = (), timeout: float = 2.0,
    hosts: dict[str, str] | None = None, admin_key: str | None = None,
) -> StatusReport:
    """Poll every part's /health, each bootstrap's /query and the proxy's /metrics.

    Given only a proxy URL, the parts and bootstraps are those the proxy's
    /health reports. `admin_key` (default: env PDKV_ADMIN_KEY) goes to the proxy's /metrics and /pdkv/* only.
    """
    import httpx

    from pdkv.proxy.guard import admin_headers

    admin = admin_headers(admin_key)

    targets, boots = list(targets), list(bootstraps)
    parts: list[PartHealth] = []
    figures: ProxyFigures | None = None
    with httpx.Client(timeout=timeout) as client:
        if proxy_url:
            status, body, err = _get(client, proxy_url.rstrip("/") + "/health")
            if not any(kind == "proxy" for _, kind, _ in targets):
                reason = err or (body.get("reason", "") if isinstance(body, dict) else "")
                why = "" if status == 200 else reason or f"answered {status}"
                parts.append(PartHealth("proxy", "proxy", proxy_url, status == 200, why))
            if isinstance(body, dict) and not targets:
                for i, b in enumerate(body.get("backends", [])):
                    targets.append((f"{b.get('role', '?')}-{i}", str(b.get("role", "?")), str(b.get("url", ""))))
                    if b.get("bootstrap"):
                        boots.append(str(b["bootstrap"]))
            figures = _proxy_figures(client, proxy_url, admin) if status is not None else None
        for name, kind, url in targets:
            status, body, err = _get(client, url.rstrip("/") + "/health")
            up = status is not None and 200 <= status < 300
            parts.append(PartHealth(name, kind, url, up, "" if up else err or f"answered {status}", host=(hosts or {}).get(name, "")))
            if kind == "proxy" and figures is None and status is not None:
                figures = _proxy_figures(client, url, admin)
        registrations: list[Registration] = []
        for boot in sorted(set(boots)):
            status, body, _ = _get(client, boot.rstrip("/") + "/query")
            if status == 200 and isinstance(body, dict):
                for dp, entry in sorted(body.items()):
                    for tp, pps in sorted((entry.get("worker_addr") or {}).items()):
                        for pp, addr in sorted(pps.items()):
                            registrations.append(Registration(boot, int(dp), str(entry.get("engine_id")), int(tp), int(pp), str(addr)))
    return StatusReport(parts=parts, registrations=registrations, proxy=figures)


def _proxy_figures(client: Any, url: str, admin: dict[str, str] | None = None) -> ProxyFigures | None:
    status, text, _ = _get(client, url.rstrip("/") + "/metrics", admin)
    if status != 200 or not isinstance(text, str):
        return None
    in_flight: dict[str, int] = {}
    errors: dict[str, int] = {}
    requests = 0
    for name, labels, value in parse_prometheus(text):
        if name == "pdkv_proxy_outstanding_requests":
            in_flight[labels.get("url", "?")] = int(value)
        elif name == "pdkv_proxy_errors_total" and value:
            errors[labels.get("cause", "?")] = int(value)
        elif name == "pdkv_proxy_requests_total":
            requests += int(value)
    status, recent, _ = _get(client, url.rstrip("/") + "/pdkv/requests?errors=1&limit=5", admin)
    return ProxyFigures(url, in_flight, requests, errors, recent if status == 200 and isinstance(recent, list) else [])
