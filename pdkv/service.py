"""Running pdkv's HTTP services (bootstrap, proxy) with uvicorn's lifecycle:
start-up, serve until a signal, graceful shutdown with a bound, signals restored.

Services are aiohttp applications. `serve_forever` is for the CLI;
`BackgroundService` runs one on its own thread and event loop, for tests and
for a bootstrap server started inside a vLLM worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

from pdkv.errors import StartError

DEFAULT_SHUTDOWN_TIMEOUT = 5.0


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, reuse_port=False, backlog=1024)
    except OSError as exc:
        raise StartError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc}",
            hint="pick another --port or stop what holds this one",
        ) from None
    sock.setblocking(False)
    return sock


async def _start(app: Any, sock: socket.socket, shutdown_timeout: float):
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None, shutdown_timeout=shutdown_timeout, handle_signals=False)
    await runner.setup()
    site = web.SockSite(runner, sock, shutdown_timeout=shutdown_timeout, backlog=1024)
    await site.start()
    return runner


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """On the running loop: an Event that SIGINT or SIGTERM sets; the handlers are removed on exit."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        yield stop
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)


def serve_forever(
    app: Any,
    host: str,
    port: int,
    *,
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    on_ready: Callable[[str, int], None] | None = None,
) -> None:
    """Serve `app` until SIGINT or SIGTERM, then shut down within `shutdown_timeout`."""
    sock = _bind(host, port)
    bound_port = sock.getsockname()[1]

    async def main() -> None:
        with stop_on_signals() as stop:
            runner = await _start(app, sock, shutdown_timeout)
            try:
                if on_ready is not None:
                    on_ready(host, bound_port)
                await stop.wait()
            finally:
                await asyncio.wait_for(runner.cleanup(), timeout=shutdown_timeout + 1)

    asyncio.run(main())


class BackgroundLoop:
    """A server on a daemon thread with its own event loop; `with X(...) as svc:` starts and stops it.

    Subclasses say how to start (`_startup`, on the loop), stop (`_shutdown`,
    on the loop) and release what outlives the loop (`_release`). Start-up
    and shutdown are bounded; a start-up error is raised by `start()`.
    """

    label = "service"

    def __init__(self, *, shutdown_timeout: float = 2.0) -> None:
        self.shutdown_timeout = shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: asyncio.Event | None = None

    async def _startup(self) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        """Release what the loop does not own (listening sockets), after the thread ends."""

    def start(self, timeout: float = 10.0) -> BackgroundLoop:
        self._thread = threading.Thread(target=self._run, name=f"pdkv-{self.label}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            raise StartError(f"{self.label} did not start within {timeout:.0f} s")
        if self._error is not None:
            raise StartError(f"{self.label} failed to start: {self._error}") from self._error
        return self

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                await self._startup()
            except BaseException as exc:  # surfaced to start()
                self._error = exc
                self._ready.set()
                return
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                await asyncio.wait_for(self._shutdown(), timeout=self.shutdown_timeout + 1)

        try:
            loop.run_until_complete(main())
        finally:
            loop.close()

    def call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run `fn` on the loop's thread and return its result (to read loop-owned state safely)."""
        assert self._loop is not None

        async def on_loop() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(on_loop(), self._loop).result(timeout)

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and not self._loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=self.shutdown_timeout + 2)
        self._release()

    def __enter__(self) -> BackgroundLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class BackgroundService(BackgroundLoop):
    """Run an aiohttp app on a daemon thread: `with BackgroundService(app) as svc: svc.url`.

    `port=0` picks a free port. Start-up and shutdown are bounded.
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, *, shutdown_timeout: float = 2.0) -> None:
        super().__init__(shutdown_timeout=shutdown_timeout)
        self.app = app
        self.host = host
        self._sock = _bind(host, port)
        self.port: int = self._sock.getsockname()[1]
        self.label = f"service on {host}:{self.port}"
        self._runner: Any = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def _startup(self) -> None:
        self._runner = await _start(self.app, self._sock, self.shutdown_timeout)

    async def _shutdown(self) -> None:
        await self._runner.cleanup()

    def _release(self) -> None:
        self._sock.close()

    def start(self, timeout: float = 10.0) -> BackgroundService:
        super().start(timeout)
        return self

    def __enter__(self) -> BackgroundService:
        return self.start()
