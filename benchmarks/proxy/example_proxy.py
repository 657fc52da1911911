"""A re-implementation of the behaviour of vLLM's example MooncakeConnector proxy, for comparison.

What it reproduces (examples/online_serving/disaggregated_serving/mooncake_connector/):
- FastAPI served by uvicorn (loop "auto": uvloop when installed);
- one httpx.AsyncClient per backend, timeout None, unlimited connections and keep-alive;
- round-robin over prefill and decode servers;
- the prefill request (max_tokens 1, stream false, kv_transfer_params
  do_remote_decode) fired with asyncio.create_task and never awaited by the
  handler, so its outcome never reaches the client;
- the decode request streamed back through StreamingResponse over
  `response.aiter_bytes()`, with media type application/json;
- a fresh uuid4 request id per request, sent as X-Request-Id.

Run: python benchmarks/proxy/example_proxy.py --port 8001 --prefill http://127.0.0.1:9100 9300 --decode http://127.0.0.1:9200
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import uuid
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

ARGS: argparse.Namespace


def _client(url: str) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=url, timeout=None, limits=httpx.Limits(max_connections=None, max_keepalive_connections=None)
    )


@asynccontextmanager
async def lifespan(app: FastAPI):
    app.state.prefills = [
        {"client": _client(url), "host": urlsplit(url).hostname, "bootstrap_port": port} for url, port in ARGS.prefill
    ]
    app.state.decodes = [{"client": _client(url)} for url in ARGS.decode]
    app.state.p_cycle = itertools.cycle(app.state.prefills)
    app.state.d_cycle = itertools.cycle(app.state.decodes)
    yield
    for backend in (*app.state.prefills, *app.state.decodes):
        await backend["client"].aclose()


app = FastAPI(lifespan=lifespan)


async def _prefill(backend: dict, path: str, body: dict, request_id: str) -> None:
    body = dict(body)
    body["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    body["stream"] = False
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body.pop("stream_options", None)
    response = await backend["client"].post(path, json=body, headers={"X-Request-Id": request_id})
    response.raise_for_status()
    await response.aclose()


async def _decode(p_backend: dict, d_backend: dict, path: str, body: dict, request_id: str):
    body["kv_transfer_params"] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "bootstrap_server_host": p_backend["host"],
        "bootstrap_server_port": p_backend["bootstrap_port"],
    }
    async with d_backend["client"].stream("POST", path, json=body, headers={"X-Request-Id": request_id}) as response:
        response.raise_for_status()
        async for chunk in response.aiter_bytes():
            yield chunk


async def _handle(path: str, request: Request) -> StreamingResponse:
    body = await request.json()
    request_id = str(uuid.uuid4())
    p_backend = next(request.app.state.p_cycle)
    asyncio.create_task(_prefill(p_backend, path, body, request_id))
    d_backend = next(request.app.state.d_cycle)
    return StreamingResponse(_decode(p_backend, d_backend, path, body, request_id), media_type="application/json")


@app.post("/v1/completions")
async def completions(request: Request) -> StreamingResponse:
    return await _handle("/v1/completions", request)


@app.post("/v1/chat/completions")
async def chat_completions(request: Request) -> StreamingResponse:
    return await _handle("/v1/chat/completions", request)


@app.get("/healthcheck")
async def healthcheck() -> dict:
    return {"status": "ok"}


def main() -> None:
    global ARGS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", nargs="+", action="append", required=True, metavar=("URL", "BOOTSTRAP_PORT"))
    ap.add_argument("--decode", action="append", required=True)
    ARGS = ap.parse_args()
    ARGS.prefill = [(p[0], int(p[1]) if len(p) > 1 else 8998) for p in ARGS.prefill]

    import uvicorn

    uvicorn.run(app, host=ARGS.host, port=ARGS.port, log_level="warning")


if __name__ == "__main__":
    main()
