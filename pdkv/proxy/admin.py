"""The proxy's own routes under /pdkv/ (behind the admin key when one is set: pdkv.proxy.guard); their messages
are pdkv.proxy_api's, which its client decodes.

    GET  /pdkv/requests[?limit=N&errors=1]   recent per-request timings, newest first
    GET  /pdkv/requests/{request_id}         one request's timing (request or transfer id)
    GET  /pdkv/planner                       the planner's last round (pdkv.proxy.planner_loop); 404 when it is off
    POST /pdkv/drain  {"url": U[, "draining": false]}
                                             route no new request to backend U (or again); answers its requests in flight
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from pdkv.errors import ConfigError
from pdkv.proxy.config import parse_decode
from pdkv.proxy.error_answers import error_body
from pdkv.proxy.listener import Request, ServerConnection
from pdkv.proxy_api import DRAIN_PATH, PLANNER_PATH, REQUESTS_PATH, DrainAnswer, DrainRequest

if TYPE_CHECKING:
    from pdkv.proxy.backends import Backends
    from pdkv.proxy.metrics import TimingLog
    from pdkv.proxy.planner_loop import PlannerLoop

_encode = msgspec.json.Encoder().encode


ROUTES = {REQUESTS_PATH: "GET", PLANNER_PATH: "GET", DRAIN_PATH: "POST"}


class AdminRoutes:
    """Answers every /pdkv/ path; owned by the proxy's event loop like the state it reads."""

    def __init__(self, backends: Backends, timings: TimingLog, planner: PlannerLoop | None) -> None:
        self.backends, self.timings, self.planner = backends, timings, planner

    def handle(self, req: Request, conn: ServerConnection) -> None:
        path, method = req.path, req.method
        want = "GET" if path.startswith(REQUESTS_PATH + "/") else ROUTES.get(path)
        if want is None:
            conn.respond(404, error_body(404, f"no route {method} {path}", "bad_request"))
        elif method != want:
            conn.respond(405, error_body(405, f"{path} takes {want}", "bad_request"))
        elif path == REQUESTS_PATH:
            conn.respond(200, _encode(self.timings.query(req.query)))
        elif path.startswith(REQUESTS_PATH + "/"):
            timing = self.timings.get(path[len(REQUESTS_PATH) + 1 :])
            if timing is None:
                conn.respond(404, error_body(404, "no such request in the proxy's recent log", "bad_request"))
            else:
                conn.respond(200, _encode(timing))
        elif path == PLANNER_PATH:
            if self.planner is None:
                conn.respond(404, error_body(404, "the planner is off; start the proxy with --planner-profile and --slo", "bad_request"))
            else:
                conn.respond(200, _encode(self.planner.view()))
        else:
            self.drain(req, conn)

    def drain(self, req: Request, conn: ServerConnection) -> None:
        try:
            ask = msgspec.json.decode(req.body, type=DrainRequest)
        except msgspec.DecodeError as exc:
            conn.respond(400, error_body(400, f'POST /pdkv/drain takes {{"url": URL, "draining": true|false}}: {exc}', "bad_request"))
            return
        try:
            url = parse_decode(ask.url)
        except ConfigError as exc:
            conn.respond(400, error_body(400, exc.message, "bad_request"))
            return
        state = self.backends.drain(url, ask.draining)
        if state is None:
            conn.respond(404, error_body(404, f"no backend at {ask.url}", "bad_request"))
            return
        conn.respond(200, _encode(DrainAnswer(state.url, state.role, state.draining, self.backends.busy(state))))
