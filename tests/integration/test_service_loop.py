"""pdkv.service's loop thread (the connector's side channels run on it) and BackgroundLoop on top of it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdkv.errors import StartError
from pdkv.service import BackgroundLoop, EventLoopThread


def test_the_side_channel_runs_on_the_one_loop_thread():
    from pdkv.connector import side_channel

    assert side_channel.EventLoopThread is EventLoopThread


def test_submit_call_and_a_closed_loop_drops_call_soon():
    t = EventLoopThread("pdkv-test")
    try:
        assert t.submit(asyncio.sleep(0, "slept")).result(5) == "slept"
        assert t.call(threading.current_thread).name == "pdkv-test"
        pending = t.submit(asyncio.sleep(3600))
    finally:
        t.stop()
    assert pending.cancelled() and t.loop.is_closed()
    t.call_soon(print, "never runs")  # the owner is shutting down: dropped, no error
    t.stop()  # twice is fine


class _Recorder(BackgroundLoop):
    label = "recorder"

    def __init__(self, fail: bool = False) -> None:
        super().__init__(shutdown_timeout=0.5)
        self.fail = fail
        self.seen: list[str] = []

    async def _startup(self) -> None:
        self.seen.append("startup")
        if self.fail:
            raise OSError("no such device")

    async def _shutdown(self) -> None:
        self.seen.append("shutdown")

    def _release(self) -> None:
        self.seen.append("release")


def test_background_loop_starts_serves_and_stops_in_order():
    with _Recorder() as svc:
        assert svc.call(lambda: threading.current_thread().name) == "pdkv-recorder"
    assert svc.seen == ["startup", "shutdown", "release"]
    assert svc._thread is not None and svc._thread.loop.is_closed()


def test_background_loop_start_up_error_is_raised_and_its_loop_stopped():
    svc = _Recorder(fail=True)
    with pytest.raises(StartError, match="recorder failed to start: no such device"):
        svc.start()
    assert svc._thread is not None and svc._thread.loop.is_closed()
