"""`pdkv bench --transport ipc` on real GPUs: every layout's bytes verified through the bench's own checks."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu


def test_bench_ipc_all_layouts_verified():
    import torch

    from pdkv.bench.runner import BenchSpec, run_bench
    from pdkv.geometry import dense_geometry

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    spec = BenchSpec(
        dense_geometry(4, 8, 128, "bfloat16"),
        blocks=[7], layouts=["contiguous", "per-block", "scattered"], transport="ipc",
        src="cuda:0", dst="cuda:1", iters=3, warmup=1, baseline=True,
    )
    report = run_bench(spec)
    assert report.transport == "ipc" and report.note is None
    assert [c.verified for c in report.cases] == [True, True, True]
    assert all(c.baseline is not None and c.baseline.bare.p50_ms > 0 for c in report.cases)
