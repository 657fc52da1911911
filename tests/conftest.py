from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture
def qwen3_8b() -> Path:
    return FIXTURES / "configs" / "qwen3-8b"


_PYTEST_PID = os.getpid()


def _interrupted(signum: int, frame) -> None:
    if os.getpid() != _PYTEST_PID:  # a forked child inherited this handler: it dies of the signal as it would have
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    raise KeyboardInterrupt(f"pytest got signal {signum}")


def pytest_configure(config) -> None:
    # A run ended by SIGTERM (a CI job's timeout, `timeout`, `kill`) ends as Ctrl-C does: pytest still runs the
    # fixtures' teardown, which stops the vLLM engines and deployments they started, instead of leaving them running.
    signal.signal(signal.SIGTERM, _interrupted)


def _has_cuda() -> bool:
    # Cheap: no torch import at collection time.
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
