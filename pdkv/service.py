"""Running pdkv's services with uvicorn's lifecycle: start-up, serve until a
signal, graceful shutdown with a bound, signals restored.

`listen` binds every listening socket (bootstrap and proxy). `EventLoopThread`
is the one asyncio-loop-on-a-thread: the connector's side channels run on it,
and `BackgroundLoop` (a service on its own thread: the proxy's
BackgroundProxy, BackgroundService below) starts and stops on it.
`serve_forever` and `BackgroundService` serve an aiohttp application (the
bootstrap server; tests' fake engines); the proxy has its own asyncio server
(pdkv.proxy.server) on the same pieces.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Coroutine, Iterator
from typing import Any

from pdkv.errors import StartError

log = logging.getLogger("pdkv")

DEFAULT_SHUTDOWN_TIMEOUT = 5.0


def listen(host: str, port: int, *, backlog: int = 1024) -> socket.socket:
    """A non-blocking socket listening on host:port (IPv6 when `host` has a colon; port 0 picks one).
    Raises StartError naming the address when it cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, reuse_port=False, backlog=backlog)
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
    sock = listen(host, port)
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


class EventLoopThread:
    """An asyncio loop on a daemon thread, running from construction until `stop()`.

    `submit` runs a coroutine there from any thread; `call_soon` a callback,
    dropped once the loop is closed (its owner is shutting down); `call` a
    function whose result it returns. `stop` cancels the tasks left, then
    stops and closes the loop.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop; dropped once the loop is closed (its owner is shutting down)."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            if not self.loop.is_closed():
                raise

    def call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run `fn` on the loop's thread and return its result (to read loop-owned state safely)."""

        async def on_loop() -> Any:
            return fn()

        return self.submit(on_loop()).result(timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop.is_closed():
            return

        async def _cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(_cancel_all()).result(timeout)
        except Exception:  # noqa: BLE001 - shutting down; nothing left to report to
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


class BackgroundLoop:
    """A server on its own EventLoopThread; `with X(...) as svc:` starts and stops it.

    Subclasses say how to start (`_startup`, on the loop), stop (`_shutdown`,
    on the loop) and release what outlives the loop (`_release`). Start-up
    and shutdown are bounded; a start-up error is raised by `start()`.
    """

    label = "service"

    def __init__(self, *, shutdown_timeout: float = 2.0) -> None:
        self.shutdown_timeout = shutdown_timeout
        self._thread: EventLoopThread | None = None

    async def _startup(self) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        raise NotImplementedError

    def _release(self) -> None:
        """Release what the loop does not own (listening sockets), after the thread ends."""

    def start(self, timeout: float = 10.0) -> BackgroundLoop:
        thread = self._thread = EventLoopThread(f"pdkv-{self.label}")
        try:
            thread.submit(self._startup()).result(timeout)
        except concurrent.futures.TimeoutError:
            thread.stop(self.shutdown_timeout)
            raise StartError(f"{self.label} did not start within {timeout:.0f} s") from None
        except Exception as exc:
            thread.stop(self.shutdown_timeout)
            raise StartError(f"{self.label} failed to start: {exc}") from exc
        return self

    def call(self, fn: Callable[[], Any], timeout: float = 5.0) -> Any:
        """Run `fn` on the loop's thread and return its result (to read loop-owned state safely)."""
        assert self._thread is not None
        return self._thread.call(fn, timeout)

    def stop(self) -> None:
        thread = self._thread
        if thread is not None and not thread.loop.is_closed():
            try:
                thread.submit(asyncio.wait_for(self._shutdown(), self.shutdown_timeout + 1)).result(self.shutdown_timeout + 2)
            except Exception:  # noqa: BLE001 - what is left is cancelled below; stopping goes on
                log.warning("%s: shutdown did not finish cleanly", self.label, exc_info=True)
            thread.stop(self.shutdown_timeout)
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
        self._sock = listen(host, port)
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
