"""pdkv's P/D proxying on an aiohttp server with httpx's or aiohttp's client, to measure the clients.

The same work as pdkv's request path (parse, rewrite both copies with
pdkv.proxy.routing, dispatch P and D at once, stream D back, check P's status),
minus health checks and metrics. It answers "would httpx or aiohttp's client
have been fast enough?" in benchmarks/proxy/run.py.

Run: python benchmarks/proxy/client_variants.py --client httpx --port 8003 \
        --prefill http://127.0.0.1:9100 --bootstrap http://127.0.0.1:9300 --decode http://127.0.0.1:9200
"""

from __future__ import annotations

import argparse
import asyncio
import uuid

import msgspec
from aiohttp import web

from pdkv.auth import new_binding
from pdkv.wire import new_transfer_id
from pdkv.proxy.rewrite import decode_request, prefill_request
from pdkv.proxy.routing import PrefillTarget


def build_app(args: argparse.Namespace) -> web.Application:
    target = PrefillTarget(args.prefill, args.bootstrap, 0, 1, "stub-engine-0")
    state: dict = {}

    async def start(app: web.Application) -> None:
        if args.client == "httpx":
            import httpx

            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            state["p"] = httpx.AsyncClient(base_url=args.prefill, timeout=60, limits=limits)
            state["d"] = httpx.AsyncClient(base_url=args.decode, timeout=60, limits=limits)
        else:
            import aiohttp

            connector = aiohttp.TCPConnector(limit=0)
            state["s"] = aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=60))

    async def stop(app: web.Application) -> None:
        for key in ("p", "d"):
            if key in state:
                await state[key].aclose()
        if "s" in state:
            await state["s"].close()

    async def handle(request: web.Request) -> web.StreamResponse:
        body = msgspec.json.decode(await request.read())
        rid = request.headers.get("X-Request-Id") or uuid.uuid4().hex
        tid = new_transfer_id()  # as pdkv's proxy: minted, and bound to the D
        secret, commitment = new_binding()
        p_body = msgspec.json.encode(prefill_request(body, tid, commitment))
        d_body = msgspec.json.encode(decode_request(body, tid, target, secret))
        headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        if args.client == "httpx":
            p_task = asyncio.ensure_future(state["p"].post(request.path, content=p_body, headers=headers))
            d_req = state["d"].build_request("POST", request.path, content=d_body, headers=headers)
            d_resp = await state["d"].send(d_req, stream=True)
            try:
                await resp.prepare(request)
                async for chunk in d_resp.aiter_raw():
                    await resp.write(chunk)
            finally:
                await d_resp.aclose()
            p_resp = await p_task
            p_resp.raise_for_status()
        else:
            s = state["s"]

            async def prefill() -> int:
                async with s.post(args.prefill + request.path, data=p_body, headers=headers) as r:
                    await r.read()
                    return r.status

            p_task = asyncio.ensure_future(prefill())
            async with s.post(args.decode + request.path, data=d_body, headers=headers) as d_resp:
                await resp.prepare(request)
                async for chunk in d_resp.content.iter_any():
                    await resp.write(chunk)
            if await p_task != 200:
                raise web.HTTPBadGateway()
        await resp.write_eof()
        return resp

    app = web.Application()
    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--client", choices=("httpx", "aiohttp"), required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--decode", required=True)
    ap.add_argument("--no-uvloop", action="store_true")
    args = ap.parse_args()
    loop_factory = None
    if not args.no_uvloop:
        import uvloop

        loop_factory = uvloop.new_event_loop
    web.run_app(build_app(args), host="127.0.0.1", port=args.port, access_log=None, print=None,
                loop=loop_factory() if loop_factory else None)


if __name__ == "__main__":
    main()
