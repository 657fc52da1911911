"""The bootstrap HTTP server: vLLM's MooncakeBootstrapServer protocol plus
deregistration, liveness probing, /health, /metrics and an optional token.

Routes:
    POST /register     RegisterRequest -> 200 {"status": "ok", "result": ...}
    POST /deregister   DeregisterRequest -> 200 {"status": "ok", "removed": n}
    GET  /query        {"<dp>": {"engine_id", "worker_addr": {"<tp>": {"<pp>": addr}}}}
    GET  /health       {"status": "ok", "engines": n, "workers": n}
    GET  /metrics      Prometheus text
    POST /pdkv/members        MemberRecord -> 200 {"status": "ok", "result": "joined"|"renewed"}
    POST /pdkv/members/leave  LeaveRequest -> 200 {"status": "ok", "removed": 0|1}
    GET  /pdkv/members        {"version": n, "members": [{"record": MemberRecord, "expires_in_s": s}]}
Errors answer {"detail": message}: 400 malformed JSON, 422 wrong fields (a
rank outside [0, 65536) among them: pdkv.bounds.MAX_RANK), 401 missing or
wrong token, 409 conflict; the registry is unchanged by any of them.

Liveness: an engine is dead when none of its side-channel addresses accepts a
TCP connection. A conflicting registration evicts a dead holder at once; a
periodic sweep drops an engine found dead `probe_failures` times in a row.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdkv.bootstrap.members import MAX_MEMBERS, MemberTable
from pdkv.bootstrap.registry import BootstrapRegistry, Conflict, ConflictKind, Outcome
from pdkv.errors import RegistryConflict
from pdkv.metrics import CONTENT_TYPE, render
from pdkv.wire import (
    DeregisterRequest,
    DeregisterResponse,
    ErrorResponse,
    HealthResponse,
    LeaveRequest,
    MemberRecord,
    RegisterRequest,
    RegisterResponse,
    split_worker_addr,
)
from pdkv.service import BackgroundService, serve_forever

log = logging.getLogger("pdkv.bootstrap")

MAX_BODY = 64 * 1024


@dataclass(frozen=True)
class ProbePolicy:
    """How liveness is probed. `interval=0` turns the periodic sweep off
    (conflicting registrations still probe the holder)."""

    timeout: float = 0.5
    interval: float = 10.0
    failures: int = 3


class BootstrapMetrics:
    """What GET /metrics shows, on its own prometheus_client registry: counters the handlers bump and
    the registry's size, read when rendered."""

    def __init__(self, engines: BootstrapRegistry, members: MemberTable) -> None:
        self.registry = r = CollectorRegistry()
        registrations = Counter("pdkv_bootstrap_registrations_total", "Accepted POST /register calls, by result.", ["result"], registry=r)
        self.registrations = {o.value: registrations.labels(o.value) for o in Outcome}
        rejects = Counter(
            "pdkv_bootstrap_rejects_total", "Refused POST /register and /deregister calls, by reason.", ["reason"], registry=r
        )
        self.rejects = {k: rejects.labels(k) for k in ("conflict", "invalid", "unauthorized")}
        self.queries = Counter("pdkv_bootstrap_queries_total", "GET /query calls answered.", registry=r)
        self.deregistrations = Counter("pdkv_bootstrap_deregistrations_total", "POST /deregister calls accepted.", registry=r)
        self.evictions = Counter("pdkv_bootstrap_evictions_total", "Engines dropped by the liveness sweep.", registry=r)
        Gauge("pdkv_bootstrap_engines", "DP ranks with a registered engine.", registry=r).set_function(lambda: engines.engine_count)
        Gauge("pdkv_bootstrap_workers", "Registered worker addresses.", registry=r).set_function(lambda: engines.worker_count)
        Gauge("pdkv_bootstrap_members", "Live members (engines with an unexpired lease).", registry=r).set_function(lambda: len(members))
        changes = Counter("pdkv_bootstrap_member_changes_total", "Members that joined, left or expired.", ["change"], registry=r)
        self.member_changes = {k: changes.labels(k) for k in ("joined", "changed", "left", "expired")}

    def render(self) -> str:
        return render(self.registry)


REGISTRY = web.AppKey("pdkv_bootstrap_registry", BootstrapRegistry)
METRICS = web.AppKey("pdkv_bootstrap_metrics", BootstrapMetrics)


async def accepts_connection(addr: str, timeout: float) -> bool:
    """True if `tcp://host:port` accepts a TCP connection within `timeout` seconds.

    A ZMQ ROUTER socket treats the bare connect-and-close as a failed handshake
    and drops it, so probing a live side channel disturbs nothing.
    """
    host, port = split_worker_addr(addr)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


async def _none_answers(addrs: tuple[str, ...], timeout: float) -> bool:
    results = await asyncio.gather(*(accepts_connection(a, timeout) for a in addrs))
    return not any(results)


async def holder_is_dead(conflict: Conflict, req: RegisterRequest, timeout: float) -> bool:
    """Whether the engine `conflict` names may be evicted for `req`.

    If the newcomer registers an address the holder had, the holder has lost
    that port (only one process can bind it), so only its other addresses count.
    """
    addrs = conflict.holder_addrs
    if conflict.kind is ConflictKind.ENGINE:
        addrs = tuple(a for a in addrs if a != req.addr)
    return await _none_answers(addrs, timeout)


def _error(status: int, message: str) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(ErrorResponse(message)), content_type="application/json")


def _ok(obj: Any) -> web.Response:
    return web.Response(body=msgspec.json.encode(obj), content_type="application/json")


class _Handlers:
    def __init__(self, registry: BootstrapRegistry, token: str | None, probe: ProbePolicy) -> None:
        self.registry = registry
        self.members = MemberTable()
        self.token = token
        self.probe = probe
        self.metrics = BootstrapMetrics(registry, self.members)
        self._query_cache: tuple[int, bytes] = (-1, b"")

    def _unauthorized(self, request: web.Request) -> web.Response | None:
        if not self.token:
            return None
        given = request.headers.get("Authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode()):
            return None
        self.metrics.rejects["unauthorized"].inc()
        what = "a wrong token" if given else "no token"
        log.warning("refused %s %s from %s: %s", request.method, request.path, request.remote, what)
        return _error(401, f"{request.path} needs the bootstrap token (Authorization: Bearer ...); got {what}")

    async def _decode(self, request: web.Request, kind: type) -> Any:
        """A write's body as `kind`, or an error response (401 without the token, 400 malformed, 413 too large,
        422 invalid)."""
        if (denied := self._unauthorized(request)) is not None:
            return denied
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self.metrics.rejects["invalid"].inc()
            return _error(413, f"body larger than {MAX_BODY} bytes")
        except ConnectionError:  # the client went away mid-body (an engine stopping as it leaves): nobody to answer
            log.info("%s %s from %s: the client closed the connection before its body arrived", request.method, request.path,
                     request.remote)
            return _error(400, "the connection closed before the body arrived")
        try:
            return msgspec.json.decode(body, type=kind)
        except msgspec.ValidationError as exc:
            self.metrics.rejects["invalid"].inc()
            return _error(422, f"invalid {request.path[1:]} request: {exc}")
        except msgspec.DecodeError as exc:
            self.metrics.rejects["invalid"].inc()
            return _error(400, f"body is not valid JSON: {exc}")

    async def register(self, request: web.Request) -> web.Response:
        req = await self._decode(request, RegisterRequest)
        if not isinstance(req, RegisterRequest):
            return req
        conflict = self.registry.check(req)
        # Registrations that land while we probe can change the conflict; re-probe a few times.
        for _ in range(3):
            evict = None
            if conflict is not None and await holder_is_dead(conflict, req, self.probe.timeout):
                evict = conflict
            try:
                outcome = self.registry.register(req, evict=evict)
                break
            except RegistryConflict as exc:
                latest = self.registry.check(req)
                if latest == conflict:
                    self.metrics.rejects["conflict"].inc()
                    holder = f"engine {conflict.holder!r} still answers at {', '.join(conflict.holder_addrs)}"
                    message = f"{exc.message}: {holder}; stop it or deregister it first"
                    log.warning("conflict: %s", message)
                    return _error(409, message)
                conflict = latest
        else:
            self.metrics.rejects["conflict"].inc()
            return _error(409, f"registration of {req.engine_id!r} at {req.addr} kept conflicting with concurrent registrations")
        self.metrics.registrations[outcome.value].inc()
        if outcome is not Outcome.UNCHANGED:
            extra = f" (evicted dead engine {conflict.holder!r})" if outcome is Outcome.REPLACED and conflict else ""
            log.info(
                "registered engine %r dp=%d tp=%d pp=%d at %s%s", req.engine_id, req.dp_rank, req.tp_rank, req.pp_rank, req.addr, extra
            )
        return _ok(RegisterResponse(result=outcome.value))

    async def deregister(self, request: web.Request) -> web.Response:
        req = await self._decode(request, DeregisterRequest)
        if not isinstance(req, DeregisterRequest):
            return req
        removed = self.registry.deregister(req.engine_id)
        self.metrics.deregistrations.inc()
        if removed:
            log.info("deregistered engine %r (%d workers)", req.engine_id, removed)
        return _ok(DeregisterResponse(status="ok", removed=removed))

    async def query(self, request: web.Request) -> web.Response:
        self.metrics.queries.inc()
        version, body = self._query_cache
        if version != self.registry.version:
            body = msgspec.json.encode(self.registry.query())
            self._query_cache = (self.registry.version, body)
        return web.Response(body=body, content_type="application/json")

    async def join(self, request: web.Request) -> web.Response:
        rec = await self._decode(request, MemberRecord)
        if not isinstance(rec, MemberRecord):
            return rec
        self._expire()
        known = self.members.has(rec.member_id)
        if not known and len(self.members) >= MAX_MEMBERS:
            self.metrics.rejects["invalid"].inc()
            return _error(429, f"the registry holds {MAX_MEMBERS} members already; refusing {rec.member_id!r}")
        if not self.members.put(rec, time.monotonic()):
            return _ok({"status": "ok", "result": "renewed"})
        self.metrics.member_changes["changed" if known else "joined"].inc()
        log.info("member %s %r %s at %s (dp %d/%d)", "changed:" if known else "joined:", rec.member_id, rec.role, rec.url,
                 rec.dp_rank, rec.dp_size)
        return _ok({"status": "ok", "result": "changed" if known else "joined"})

    async def leave(self, request: web.Request) -> web.Response:
        req = await self._decode(request, LeaveRequest)
        if not isinstance(req, LeaveRequest):
            return req
        removed = self.members.leave(req.member_id)
        if removed:
            self.metrics.member_changes["left"].inc()
            log.info("member left: %r", req.member_id)
        return _ok({"status": "ok", "removed": int(removed)})

    async def list_members(self, request: web.Request) -> web.Response:
        self._expire()
        return _ok(self.members.view(time.monotonic()))

    def _expire(self) -> None:
        for rec in self.members.expire(time.monotonic()):
            self.metrics.member_changes["expired"].inc()
            log.warning("member expired: %r %s at %s renewed no lease within %g s", rec.member_id, rec.role, rec.url, rec.ttl_s)

    async def health(self, request: web.Request) -> web.Response:
        return _ok(HealthResponse(status="ok", engines=self.registry.engine_count, workers=self.registry.worker_count))

    async def serve_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render().encode(), headers={"Content-Type": CONTENT_TYPE})

    async def sweep_once(self) -> None:
        holders = self.registry.holders()
        results = await asyncio.gather(*(_none_answers(addrs, self.probe.timeout) for _, _, addrs in holders))
        for (dp, engine_id, addrs), dead in zip(holders, results, strict=True):
            if self.registry.record_probe(dp, engine_id, alive=not dead, max_failures=self.probe.failures):
                self.metrics.evictions.inc()
                log.warning(
                    "dropped engine %r at dp=%d: %s did not answer %d probes in a row", engine_id, dp, ", ".join(addrs), self.probe.failures
                )

    async def sweep_forever(self, app: web.Application) -> AsyncIterator[None]:  # aiohttp cleanup_ctx
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.probe.interval)
                self._expire()
                try:
                    await self.sweep_once()
                except Exception:  # a sweep must never kill the server
                    log.exception("liveness sweep failed")

        task = asyncio.create_task(loop()) if self.probe.interval > 0 else None
        yield
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def make_app(registry: BootstrapRegistry | None = None, *, token: str | None = None, probe: ProbePolicy | None = None) -> web.Application:
    """The bootstrap aiohttp Application over `registry` (a new one if None).

    `token`: if set, POST /register and /deregister must carry `Authorization: Bearer <token>`.
    The registry and the metrics are reachable as `app[REGISTRY]` / `app[METRICS]`.
    """
    handlers = _Handlers(registry if registry is not None else BootstrapRegistry(), token or None, probe or ProbePolicy())
    app = web.Application(client_max_size=MAX_BODY)
    app[REGISTRY] = handlers.registry
    app[METRICS] = handlers.metrics
    app.router.add_post("/register", handlers.register)
    app.router.add_post("/deregister", handlers.deregister)
    app.router.add_get("/query", handlers.query)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/metrics", handlers.serve_metrics)
    app.router.add_post("/pdkv/members", handlers.join)
    app.router.add_post("/pdkv/members/leave", handlers.leave)
    app.router.add_get("/pdkv/members", handlers.list_members)
    app.cleanup_ctx.append(handlers.sweep_forever)
    return app


class BootstrapService(BackgroundService):
    """A bootstrap server on its own thread; `start()` is idempotent, so
    `with start_background() as svc:` and a bare `start_background()` both work."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        super().__init__(app, host, port)
        self.registry: BootstrapRegistry = app[REGISTRY]
        self.metrics: BootstrapMetrics = app[METRICS]
        self._started = False

    def start(self, timeout: float = 10.0) -> BootstrapService:
        if not self._started:
            super().start(timeout)
            self._started = True
        return self


def start_background(
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    *,
    registry: BootstrapRegistry | None = None,
    probe: ProbePolicy | None = None,
) -> BootstrapService:
    """Start a bootstrap server on a daemon thread and return it running; `.url`, `.stop()`."""
    return BootstrapService(make_app(registry, token=token, probe=probe), host, port).start()


def run_server(
    host: str,
    port: int,
    *,
    token: str | None = None,
    probe: ProbePolicy | None = None,
    on_ready: Callable[[str, int], None] | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (the CLI's entry). Raises StartError if the port cannot be bound.

    Uses uvloop when it is installed (vLLM installs it), as uvicorn does: it
    serves /query about a quarter faster. The previous loop policy is restored.
    """
    previous = asyncio.get_event_loop_policy()
    try:
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    except ImportError:
        pass
    try:
        serve_forever(make_app(token=token, probe=probe), host, port, on_ready=on_ready)
    finally:
        asyncio.set_event_loop_policy(previous)
