"""Running the proxy: start-up (listen, first health round), serve, graceful shutdown.

`serve` is for the CLI (uvloop when installed, SIGINT/SIGTERM stop it, signals
restored afterwards); `BackgroundProxy` runs one on its own thread and loop,
for tests and embedding.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

from pdkv.proxy.app import ProxyApp
from pdkv.proxy.config import ProxyConfig
from pdkv.proxy.guard import HttpGuard
from pdkv.proxy.listener import ServerConnection
from pdkv.service import BackgroundLoop, listen, stop_on_signals

DEFAULT_SHUTDOWN_TIMEOUT = 5.0


class ProxyServer:
    """One proxy on one socket: `await start()`, then `await stop()`."""

    def __init__(self, config: ProxyConfig, sock: socket.socket | None = None, *, guard: HttpGuard | None = None,
                 ssl: Any = None) -> None:
        """`guard`: who may use which route (pdkv.proxy.guard); `ssl`: an SSLContext to serve TLS with."""
        self.config = config
        self.ssl = ssl
        self.app = ProxyApp(config, guard)
        self.sock = sock if sock is not None else listen(config.host, config.port, backlog=2048)
        self.port: int = self.sock.getsockname()[1]
        self._server: asyncio.AbstractServer | None = None
        self._connections: set[ServerConnection] = set()

    async def start(self) -> None:
        """Listen, then start the app: return after its first health round (bounded by the health timeout) so
        readiness is known."""
        self._server = await asyncio.get_running_loop().create_server(
            lambda: ServerConnection(self.app.handle, self._connections), sock=self.sock, ssl=self.ssl
        )
        await self.app.start()

    async def stop(self, timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        """Stop accepting, let requests in flight finish for up to `timeout` s, then close the app."""
        if self._server is not None:
            self._server.close()
        deadline = asyncio.get_running_loop().time() + timeout
        while any(c.busy for c in self._connections) and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        for conn in list(self._connections):
            conn.abort()
        await asyncio.sleep(0)
        await self.app.close()


def serve(
    config: ProxyConfig,
    *,
    on_ready: Callable[[ProxyServer], None] | None = None,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    guard: HttpGuard | None = None,
    ssl: Any = None,
) -> None:
    """Serve until SIGINT or SIGTERM; `on_ready(server)` runs once the first health round is done."""
    server = ProxyServer(config, guard=guard, ssl=ssl)

    async def main() -> None:
        with stop_on_signals() as stop:
            try:
                await server.start()
                if on_ready is not None:
                    on_ready(server)
                await stop.wait()
            finally:
                await server.stop(shutdown_timeout)

    runner = _loop_factory()
    if runner is not None:
        with asyncio.Runner(loop_factory=runner) as r:
            r.run(main())
    else:
        asyncio.run(main())


def _loop_factory() -> Any:
    """uvloop's loop when it is installed (some 10-20% less CPU per proxied request)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


class BackgroundProxy(BackgroundLoop):
    """`with BackgroundProxy(config) as proxy: proxy.url` — a proxy on a daemon thread (port 0 picks one)."""

    def __init__(self, config: ProxyConfig, *, guard: HttpGuard | None = None, ssl: Any = None) -> None:
        super().__init__(shutdown_timeout=1.0)
        self.config = config
        self.server = ProxyServer(config, guard=guard, ssl=ssl)
        self.port = self.server.port
        self.label = f"proxy on port {self.port}"

    @property
    def url(self) -> str:
        return f"{'https' if self.server.ssl is not None else 'http'}://{self.config.host}:{self.port}"

    @property
    def app(self) -> ProxyApp:
        return self.server.app

    async def _startup(self) -> None:
        await self.server.start()

    async def _shutdown(self) -> None:
        await self.server.stop(self.shutdown_timeout)

    def _release(self) -> None:
        self.server.sock.close()

    def start(self, timeout: float = 10.0) -> BackgroundProxy:
        super().start(timeout)
        return self

    def __enter__(self) -> BackgroundProxy:
        return self.start()