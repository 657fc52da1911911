"""`pdkv bench --transport ipc` choices that need no GPU: argument checks and the logged fallback."""

from __future__ import annotations

import logging

import pytest

from pdkv.bench.runner import BenchSpec, check_spec, resolve_transport
from pdkv.errors import UsageError
from pdkv.geometry import dense_geometry

GEOMETRY = dense_geometry(2, 2, 32, "bfloat16")


def test_ipc_needs_gpu_memory_on_both_sides():
    with pytest.raises(UsageError, match="between GPUs"):
        check_spec(BenchSpec(GEOMETRY, transport="ipc", src="cpu", dst="cuda:1"))
    check_spec(BenchSpec(GEOMETRY, transport="ipc", src="cuda:0", dst="cuda:1"))


def test_unreachable_gpus_fall_back_to_tcp_with_the_reason(caplog):
    # This machine has no CUDA device, which is exactly the unreachable case.
    spec = BenchSpec(GEOMETRY, transport="ipc", src="cuda:0", dst="cuda:1")
    with caplog.at_level(logging.WARNING):
        resolved, note = resolve_transport(spec)
    assert resolved.transport == "tcp"
    assert note is not None and "fell back to Mooncake tcp" in note
    assert note in caplog.text


def test_other_transports_are_left_alone():
    spec = BenchSpec(GEOMETRY, transport="tcp")
    assert resolve_transport(spec) == (spec, None)
