"""`pdkv status`: the health of each part, the bootstrap registrations and the proxy's figures."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from pdkv.bootstrap import BootstrapClient
from pdkv.deploy.plan import Deployment, deployment_parts
from pdkv.engine_api import EngineClient
from pdkv.errors import RemoteError, UnreachableError
from pdkv.proxy_api import ProxyClient, ProxyHealth, ProxyTiming


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
    recent_errors: list[ProxyTiming]


class StatusReport(msgspec.Struct, frozen=True):
    parts: list[PartHealth]
    registrations: list[Registration]
    proxy: ProxyFigures | None

    @property
    def ok(self) -> bool:
        return all(p.up for p in self.parts)


def status_targets(dep: Deployment) -> tuple[list[tuple[str, str, str]], list[str], str | None]:
    """(parts as (name, kind, url), bootstrap URLs, proxy URL) that `pdkv status -f` polls."""
    parts = deployment_parts(dep)
    targets = [(p.launch.name, p.kind, p.launch.url) for p in parts]
    boots = sorted({p.bootstrap_url for p in parts if p.bootstrap_url})
    proxy = next((p.launch.url for p in parts if p.kind == "proxy"), None)
    return targets, boots, proxy


def part_hosts(dep: Deployment) -> dict[str, str]:
    """Part name -> its [[hosts]] name, for a fleet file (empty for one host)."""
    return {p.launch.name: p.host for p in deployment_parts(dep) if p.host}


def collect_status(
    *, proxy_url: str | None = None, targets: Sequence[tuple[str, str, str]] = (), bootstraps: Sequence[str] = (), timeout: float = 2.0,
    hosts: dict[str, str] | None = None, admin_key: str | None = None,
) -> StatusReport:
    """Poll every part's /health, each bootstrap's /query and the proxy's /metrics, each through its client.

    Given only a proxy URL, the parts and bootstraps are those the proxy's
    /health reports. `admin_key` (default: env PDKV_ADMIN_KEY) goes to the proxy's /metrics and /pdkv/* only.
    """
    targets, boots = list(targets), list(bootstraps)
    parts: list[PartHealth] = []
    figures: ProxyFigures | None = None
    if proxy_url:
        with ProxyClient(proxy_url, timeout=timeout, admin_key=admin_key) as proxy:
            try:
                health: ProxyHealth | None = proxy.health()
                err = ""
            except (UnreachableError, RemoteError) as exc:
                health, err = None, exc.message
            if not any(kind == "proxy" for _, kind, _ in targets):
                up = health is not None and health.status == "ok"
                parts.append(PartHealth("proxy", "proxy", proxy_url, up, "" if up else err or (health.reason if health else "")))
            if health is not None and not targets:
                for i, b in enumerate(health.backends):
                    targets.append((f"{b.role}-{i}", b.role, b.url))
                    if b.bootstrap:
                        boots.append(str(b.bootstrap))
            figures = _proxy_figures(proxy) if health is not None else None
    for name, kind, url in targets:
        up, err = _part_health(kind, url, timeout, admin_key)
        parts.append(PartHealth(name, kind, url, up, "" if up else err, host=(hosts or {}).get(name, "")))
        if kind == "proxy" and figures is None and up:
            with ProxyClient(url, timeout=timeout, admin_key=admin_key) as proxy:
                figures = _proxy_figures(proxy)
    registrations: list[Registration] = []
    for boot in sorted(set(boots)):
        try:
            with BootstrapClient(boot, timeout=timeout, retries=0) as bs:
                engines = bs.query()
        except (UnreachableError, RemoteError):
            continue
        for dp, entry in sorted(engines.items()):
            for tp, pps in sorted(entry.worker_addr.items(), key=lambda kv: int(kv[0])):
                for pp, addr in sorted(pps.items(), key=lambda kv: int(kv[0])):
                    registrations.append(Registration(boot, int(dp), str(entry.engine_id), int(tp), int(pp), str(addr)))
    return StatusReport(parts=parts, registrations=registrations, proxy=figures)


def _part_health(kind: str, url: str, timeout: float, admin_key: str | None) -> tuple[bool, str]:
    """(up, why not) of one part, asked through the client of its kind."""
    if kind == "proxy":
        with ProxyClient(url, timeout=timeout, admin_key=admin_key) as proxy:
            try:
                health = proxy.health()
            except (UnreachableError, RemoteError) as exc:
                return False, exc.message
            return health.status == "ok", health.reason
    if kind == "bootstrap":
        with BootstrapClient(url, timeout=timeout, retries=0) as bs:
            return (True, "") if bs.health() else (False, "unreachable or not healthy")
    with EngineClient(url, timeout=timeout) as engine:
        problem = engine.health_problem()
        return problem is None, problem or ""


def _proxy_figures(proxy: ProxyClient) -> ProxyFigures | None:
    try:
        scrape = proxy.metrics(("pdkv_proxy_outstanding_requests", "pdkv_proxy_errors_total", "pdkv_proxy_requests_total"))
    except (UnreachableError, RemoteError):
        return None
    in_flight = {k: int(v) for k, v in scrape.by_label("pdkv_proxy_outstanding_requests", "url").items()}
    errors = {k: int(v) for k, v in scrape.by_label("pdkv_proxy_errors_total", "cause").items() if v}
    try:
        recent = proxy.requests(limit=5, errors=True)
    except (UnreachableError, RemoteError):
        recent = []
    return ProxyFigures(proxy.url, in_flight, int(scrape.total("pdkv_proxy_requests_total")), errors, recent)
