"""The proxy's HTTP app: each completion goes to a prefill and a decode server at once.

Routes:
    POST /v1/completions, /v1/chat/completions   P/D proxied (streaming or not)
    GET  /v1/models                               from a decode server
    GET  /health                                  200 when a P/D pair is routable, else 503 + reason
    GET  /metrics                                 Prometheus text (with the planner's gauges when it runs)
    /pdkv/...                                     timings, the planner's view, draining (pdkv.proxy.admin)

One request: P's and D's copies are sent at the same moment (D's connector
waits for P's KV). D's first byte is forwarded as soon as it arrives. Failures
are coupled: P answering 5xx, timing out or dropping the connection before
D's first byte cancels D's copy, and D computes the prompt alone (local
fallback; with it off, the client gets the error at once); P's 4xx reaches
the client; once D has its first byte (its KV arrived) P no longer matters.
D failing cancels P and the client gets D's error; the client going away
cancels both. A transfer no D request will take is released at P. A body whose own fields the proxy
reads (CompletionFields) do not decode is a 400 before any backend sees it.
Error messages name the failed stage, never a backend's address (see
pdkv.proxy.error_answers); the addresses go to the log and the request's record.
With API keys or an admin key set (pdkv.proxy.guard) a request without the
right one is a 401 before anything else. Transfer ids are minted here (128
random bits); the client's X-Request-Id only names the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

import msgspec

from pdkv.auth import new_binding
from pdkv.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from pdkv.proxy_api import CompletionFields, ProxyHealth, ProxyTiming
from pdkv.wire import new_transfer_id
from pdkv.proxy.admin import AdminRoutes
from pdkv.proxy.backends import Backends, BackendState, PrefillState
from pdkv.proxy.config import KvConnector, Policy, ProxyConfig
from pdkv.proxy.error_answers import error_body, is_error_event, message_of, no_answer_message, redact, redact_body, status_message
from pdkv.proxy.exchanges import DecodeExchange, Flight, LocalPrefill, PrefillExchange
from pdkv.proxy.guard import HttpGuard
from pdkv.proxy.health import Health
from pdkv.proxy.http import UpstreamError, fetch
from pdkv.proxy.engine_loads import EngineLoads
from pdkv.proxy.kv_router import KvRouter
from pdkv.proxy.router import LoadRouter, Router
from pdkv.proxy.listener import Request, ServerConnection
from pdkv.proxy.metrics import ProxyMetrics, TimingLog
from pdkv.proxy.planner_loop import PlannerLoop
from pdkv.proxy.prefill_channel import release_at_prefill, transfer_fate
from pdkv.proxy.rewrite import decode_request, local_request, prefill_headers, prefill_request, unsupported_field

log = logging.getLogger("pdkv.proxy")

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")




class ProxyApp:
    """The request handlers over a `Backends` view; `handle` is the server's one entry point.

    `await start()` before the first request (health checking, the kv-aware policy's followers), `await close()`
    after the last."""

    def __init__(self, config: ProxyConfig, guard: HttpGuard | None = None) -> None:
        self.config = config
        self.guard = guard or HttpGuard()
        self.backends = Backends(config)
        self.health = Health(self.backends)
        self.metrics = ProxyMetrics()
        self.timings = TimingLog(config.trace_capacity)
        self.loads = EngineLoads(self.backends)  # the engines' own /metrics, for the kv-aware policy and the planner
        self.router: Router = (KvRouter(config.kv, self.metrics.registry, self.backends, self.loads)
                               if config.policy is Policy.KV_AWARE else LoadRouter(self.backends))
        self.health.on_events = self.router.follow  # engines' KV events learnt from the members registry
        # The desired-count signal (None when off); ConfigError here when its profile does not load.
        self.planner = PlannerLoop(config.planner, self.backends, self.loads, self.metrics.registry) if config.planner else None
        self.admin = AdminRoutes(self.backends, self.timings, self.planner)
        self._health_task: asyncio.Task | None = None
        self._planner_task: asyncio.Task | None = None

    async def start(self) -> None:
        """Start health checking (and the kv-aware policy's followers); return after the first health round, or
        once the health timeout is up, so that readiness is known."""
        self._health_task = asyncio.get_running_loop().create_task(self.health.run())
        self.router.start()
        deadline = asyncio.get_running_loop().time() + self.config.health_timeout + 1.0
        while self.health.rounds == 0 and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.01)
        if self.planner is not None:  # after the first health round: its first count of engines is a real one
            self._planner_task = asyncio.get_running_loop().create_task(self.planner.run())

    async def handle(self, req: Request, conn: ServerConnection) -> None:
        path, method = req.path, req.method
        refused = self.guard.refusal(path, req.headers.get("authorization"))
        if refused is not None:
            conn.respond(401, error_body(401, refused, "unauthorized"), headers=[("www-authenticate", "Bearer")])
            return
        if path in COMPLETION_PATHS:
            if method != "POST":
                conn.respond(405, error_body(405, f"{path} takes POST", "bad_request"))
                return
            await self.proxy(req, conn, path)
        elif path.startswith("/pdkv/"):
            self.admin.handle(req, conn)
        elif method != "GET":
            status = 405 if path in ("/health", "/metrics", "/v1/models") else 404
            conn.respond(status, error_body(status, f"no route {method} {path}", "bad_request"))
        elif path == "/health":
            ready, reason = self.backends.readiness()
            health = ProxyHealth("ok" if ready else "unavailable", reason, self.backends.report(), self.backends.notes,
                                 **self.router.health())
            conn.respond(200 if ready else 503, _json_encode(health))
        elif path == "/metrics":
            conn.respond(200, self.metrics.render(self.backends.rows()).encode(), METRICS_CONTENT_TYPE)
        elif path == "/v1/models":
            await self.models(conn)
        else:
            conn.respond(404, error_body(404, f"no route {method} {path}", "bad_request"))

    async def models(self, conn: ServerConnection) -> None:
        d = self.backends.any_decode()
        if d is None:
            conn.respond(503, error_body(503, "no decode server is known yet", "no_backend"))
            return
        try:
            ex = await fetch(d.pool, "GET", "/v1/models", timeout=self.config.health_timeout)
        except UpstreamError as exc:
            log.warning("GET /v1/models from decode %s failed: %s", d.url, exc)
            conn.respond(502, error_body(502, no_answer_message("decode", exc), f"decode_{exc.cause}"))
            return
        conn.respond(ex.status, ex.body, ex.content_type)

    # --- the P/D path -------------------------------------------------------------

    async def proxy(self, req: Request, conn: ServerConnection, endpoint: str) -> None:
        received = time.time()
        # The client's X-Request-Id names the request in logs and traces only; the transfer id is the proxy's own.
        request_id = req.headers.get("x-request-id") or uuid.uuid4().hex
        transfer_id = new_transfer_id()
        t = ProxyTiming(request_id=request_id, transfer_id=transfer_id, endpoint=endpoint, received=received)
        if not self.timings.add(t):  # 128 random bits repeated: refused rather than two requests racing for one KV
            self._finish_error(conn, t, 409, "bad_request", "transfer id collision; retry the request")
            return
        try:  # every request with a record is observed once, however it ends
            try:
                body = _json_decode(req.body)
            except msgspec.DecodeError as exc:
                body = exc
            if not isinstance(body, dict):
                self._finish_error(conn, t, 400, "bad_request", "the request body is not a JSON object")
                return
            try:
                fields = msgspec.convert(body, CompletionFields)
            except msgspec.ValidationError as exc:  # before any backend is chosen: nothing to undo
                self._finish_error(conn, t, 400, "bad_request", f"invalid request body: {exc}")
                return
            why = unsupported_field(body, self.config.connector)
            if why is not None:
                self._finish_error(conn, t, 400, "bad_request", why)
                return
            t.stream = stream = bool(fields.stream)
            auth = req.headers.get("authorization")
            d_headers = [("X-Request-Id", request_id), ("Authorization", auth)] if auth else [("X-Request-Id", request_id)]
            route = await self.router.route(body, endpoint, t)
            if route is not None and route.local is not None:  # the policy sends it to D alone
                await self._local(conn, t, body, endpoint, route.decode, d_headers, stream, route.local)
                return
            if route is None or route.pairing is None or route.prefill is None:
                reason = self.backends.readiness()[1]
                d_state = self.backends.live_decode() if self.config.local_fallback else None
                if d_state is None:
                    self._finish_error(conn, t, 503, "no_backend", redact(reason), reason)
                else:
                    await self._local(conn, t, body, endpoint, d_state, d_headers, stream, "no_prefill")
                return
            pairing, p_state, d_state = route.pairing, route.prefill, route.decode
            target = pairing.prefill
            t.prefill_url, t.prefill_dp_rank, t.decode_url = target.url, target.dp_rank, d_state.url
            headers = prefill_headers(request_id, target)
            if auth:
                headers.append(("Authorization", auth))
            # pdkv's connector: the transfer is bound to this D; P gets the commitment, D alone the secret.
            secret, commitment = new_binding() if self.config.connector is KvConnector.PDKV else ("", "")
            p_body = prefill_request(body, transfer_id, commitment)
            p_bytes = p_state.pool.request_bytes("POST", endpoint, _json_encode(p_body), headers)
            d_body = decode_request(body, transfer_id, target, secret)
            d_bytes = d_state.pool.request_bytes("POST", endpoint, _json_encode(d_body), d_headers)

            flight = Flight(asyncio.get_running_loop(), t)
            p_ex, d_ex = PrefillExchange(flight), DecodeExchange(flight)
            p_ex.set_deadline(self.config.prefill_timeout)
            d_ex.set_deadline(self.config.decode_first_byte_timeout)

            def client_gone() -> None:
                flight.client_gone = True
                p_ex.abort()
                d_ex.abort()

            conn.on_disconnect = client_gone
            self.backends.begin(pairing, d_state)
            try:
                t.prefill_dispatched = time.time()
                p_state.pool.send(p_ex, p_bytes)
                t.decode_dispatched = time.time()
                d_state.pool.send(d_ex, d_bytes)
                fallback = await self._drive(conn, t, flight, p_ex, d_ex, p_state, d_state, stream)
                if t.error is not None or fallback is not None:
                    # D's P/D copy failed or was cancelled, so no D request will take this KV (if one already has,
                    # P closed the transfer and the release is a no-op): P may free its blocks now.
                    if self.config.connector is KvConnector.PDKV:  # vLLM's connector would not understand it
                        release_at_prefill(p_state.workers.get(target.dp_rank, []), t.transfer_id, fields.n or 1, secret)
                if fallback is not None:
                    await self._local(conn, t, body, endpoint, d_state, d_headers, stream, fallback)
            finally:
                self.backends.end(pairing, p_state, d_state)
                if self.planner is not None:
                    self.planner.record(t, b"".join(p_ex.chunks), b"".join(d_ex.chunks) if not stream else b"", d_ex.events)
                self.router.finished(t)
        finally:
            self.metrics.observe(t)

    async def _local(self, conn: ServerConnection, t: ProxyTiming, body: dict[str, Any], endpoint: str, d_state: BackendState,
                     d_headers: list[tuple[str, str]], stream: bool, reason: str) -> None:
        """Serve the request from D alone (D computes the prompt), counted and noted in its record as `reason`."""
        t.local_prefill = reason
        t.decode_url, t.decode_first_byte = d_state.url, None
        log.info("request %s: decode computes the prompt itself (%s)", t.request_id, reason)
        flight = Flight(asyncio.get_running_loop(), t)
        d_ex = DecodeExchange(flight)
        d_ex.set_deadline(self.config.decode_first_byte_timeout)

        def client_gone() -> None:
            flight.client_gone = True
            d_ex.abort()

        conn.on_disconnect = client_gone
        self.backends.begin_local(d_state)
        try:
            t.decode_dispatched = time.time()
            d_state.pool.send(d_ex, d_state.pool.request_bytes("POST", endpoint, _json_encode(local_request(body)), d_headers))
            await self._drive(conn, t, flight, LocalPrefill(flight), d_ex, None, d_state, stream)
        finally:
            self.backends.end_local(d_state)

    async def _drive(
        self, conn: ServerConnection, t: ProxyTiming, flight: Flight, p_ex: PrefillExchange, d_ex: DecodeExchange,
        p_state: PrefillState | None, d_state: BackendState, stream: bool,
    ) -> str | None:
        """Answer the client from the two exchanges; returns why D should now compute the prompt itself
        (P failed before D's KV could come, and local fallback is on), else None once the client has its answer."""
        committed = False
        while True:
            if flight.client_gone:
                t.error, t.status, t.last_byte = "client_disconnect", 499, time.time()
                return None
            # Prefill failed before D's first byte (once D has it, the KV has arrived and P no longer matters):
            # D cannot get its KV, so it is cancelled now rather than left to time out.
            if p_state is not None and not d_ex.first and (p_ex.error is not None or (p_ex.finished and not 200 <= p_ex.status < 300)):
                d_ex.abort()
                status, cause, message, detail = self._prefill_failure(p_ex, p_state)
                if self.config.local_fallback and status >= 500:
                    log.warning("request %s: %s; decode computes the prompt itself", t.request_id, detail)
                    t.detail = detail
                    return f"prefill_failed: {cause}"
                self._fail(conn, t, committed, status, cause, message, detail)
                return None
            if d_ex.error is not None:
                p_ex.abort()
                err = d_ex.error
                if err.cause == "connect":
                    self.backends.connect_failed(d_state, str(err))
                self._fail(conn, t, committed, 504 if err.cause == "timeout" else 502, f"decode_{err.cause}",
                           no_answer_message("decode", err), f"decode {d_state.url}: {err}")
                return None
            if d_ex.status and not 200 <= d_ex.status < 300:
                if d_ex.finished:  # D's own error goes to the client as D wrote it, with the transfer's fate
                    p_ex.abort()
                    t.status = d_ex.status
                    body = b"".join(d_ex.chunks)
                    detail = f"decode {d_state.url} answered {d_ex.status}: {body[:500].decode('utf-8', 'replace')}"
                    why = await self._transfer_fate(p_state, t) if d_ex.status >= 500 else None
                    if why is None:
                        self._record(t, "decode_status", detail)
                        body = redact_body(body)
                    else:
                        self._record(t, "decode_kv_transfer", f"{detail}; {why}")
                        body = error_body(d_ex.status, f"{status_message('decode', d_ex.status, body)}; {redact(why)}",
                                          "decode_kv_transfer", t.request_id)
                        d_ex.content_type = "application/json"
                    conn.respond(d_ex.status, body, d_ex.content_type, [("x-request-id", t.request_id)])
                    t.last_byte = time.time()
                    return None
            elif stream:
                if not committed and d_ex.first and is_error_event(d_ex.chunks):
                    # D failed before its first token: say why the KV did not come, if P knows.
                    why = await self._transfer_fate(p_state, t)
                    if why is not None:
                        p_ex.abort()
                        said = message_of(b"".join(d_ex.chunks)[6:])
                        self._record(t, "decode_kv_transfer", f"decode {d_state.url} failed ({said}): {why}")
                        message = f"decode failed ({redact(said)}): {redact(why)}"
                        t.status = d_ex.status
                        conn.start_stream(d_ex.status, d_ex.content_type, [("x-request-id", t.request_id)])
                        conn.end_stream(b"data: " + error_body(500, message, "decode_kv_transfer", t.request_id) + b"\n\ndata: [DONE]\n\n")
                        d_ex.abort()
                        t.last_byte = time.time()
                        return None
                if not committed and (d_ex.first or d_ex.finished):
                    committed = True
                    head = b"".join(d_ex.chunks)
                    if is_error_event(d_ex.chunks):  # D's own error event reaches the client, minus addresses
                        head = redact_body(head)
                    conn.start_stream(d_ex.status, d_ex.content_type, [("x-request-id", t.request_id)], head)
                    d_ex.chunks = []
                    d_ex.sink = conn.write_chunk
                if committed and d_ex.finished:
                    conn.end_stream()
                    t.status, t.last_byte = d_ex.status, time.time()
                    return None
            elif d_ex.finished and p_ex.finished:
                conn.respond(d_ex.status, b"".join(d_ex.chunks), d_ex.content_type, [("x-request-id", t.request_id)])
                t.status, t.last_byte = d_ex.status, time.time()
                return None
            await flight.wait()

    async def _transfer_fate(self, p_state: PrefillState | None, t: ProxyTiming) -> str | None:
        return None if p_state is None else await transfer_fate(p_state.workers.get(t.prefill_dp_rank or 0, []), t)

    def _prefill_failure(self, p_ex: PrefillExchange, p_state: PrefillState) -> tuple[int, str, str, str]:
        """(status, cause, client message, detail) of a failed prefill."""
        err = p_ex.error
        if err is not None:
            if err.cause == "connect":
                self.backends.connect_failed(p_state, str(err))
            status = 504 if err.cause == "timeout" else 502
            return status, f"prefill_{err.cause}", no_answer_message("prefill", err), f"prefill {p_state.url}: {err}"
        body = b"".join(p_ex.chunks)
        detail = f"prefill {p_state.url} answered {p_ex.status}: {body[:500].decode('utf-8', 'replace')}"
        # A 4xx is about the request itself (too long, bad field): the client should see it as such.
        status = p_ex.status if 400 <= p_ex.status < 500 else 502
        return status, "prefill_status", status_message("prefill", p_ex.status, body), detail

    def _fail(self, conn: ServerConnection, t: ProxyTiming, committed: bool, status: int, cause: str, message: str,
              detail: str) -> None:
        if committed:
            # The client already has D's 200 and some events: end the stream with an error event.
            self._record(t, cause, detail)
            t.last_byte = time.time()
            event = b"data: " + error_body(status, message, cause, t.request_id) + b"\n\ndata: [DONE]\n\n"
            conn.end_stream(event)
            return
        self._finish_error(conn, t, status, cause, message, detail)

    def _finish_error(self, conn: ServerConnection, t: ProxyTiming, status: int, cause: str, message: str,
                      detail: str | None = None) -> None:
        """Answer the client `message` (fit for it: no addresses); `detail` (default: the message) is the record's."""
        self._record(t, cause, detail or message)
        t.status = status
        conn.respond(status, error_body(status, message, cause, t.request_id), headers=[("x-request-id", t.request_id)])
        t.last_byte = time.time()

    def _record(self, t: ProxyTiming, cause: str, detail: str) -> None:
        """Note why the request failed in its record, and in the log unless the client caused it."""
        t.error, t.detail = cause, detail
        if cause not in ("bad_request", "no_backend", "client_disconnect"):
            log.warning("request %s failed (%s): %s", t.request_id, cause, detail)

    async def close(self) -> None:
        """Stop health checking, the planner and the kv-aware policy, and close every upstream connection."""
        for task in (self._health_task, self._planner_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._health_task = self._planner_task = None
        await self.router.close()
        await self.health.close()
        await self.backends.close()
