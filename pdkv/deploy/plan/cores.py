"""Which CPU cores each engine is bound to, from one module: reading a core list, splitting an engine's cores over
its TP ranks, the local 1P1D's split of this host, and the cores of an engine `[autoscale]` adds. Pure but for
asking how many cores this process may use.

An engine's cores are its `omp_bind` (VLLM_CPU_OMP_THREADS_BIND's value): "0", "0-3", "0,2" or "0-1|2-3" (one
run of cores per rank). pdkv.deploy.plan.engine binds every process of a CPU engine to them; pre-flight
(pdkv.deploy.run.preflight) checks that this host has them.
"""

from __future__ import annotations

import os

from pdkv.errors import UsageError


def parse_cores(bind: str | None) -> list[int] | None:
    """The cores a VLLM_CPU_OMP_THREADS_BIND value names ("0", "0-3", "0,2", "0-1|2-3"), or None ("auto", "nobind")."""
    if bind is None or bind.strip() in ("", "auto", "all", "nobind"):
        return None
    cores: set[int] = set()
    try:
        for part in bind.replace("|", ",").split(","):
            lo, _, hi = part.strip().partition("-")
            cores.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UsageError(f"cannot read the core list {bind!r}", hint="write cores like 0, 0-3, 0,2 or 0-1|2-3") from None
    return sorted(cores)


def rank_cores(bind: str, tp: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for an engine of `tp` CPU ranks, each on cores of its own: a value naming each
    rank's cores ("0|1"; vLLM checks it against its ranks, data-parallel ones too) as given, a plain core list split
    evenly ("0-3", TP 2: "0,1|2,3"). UsageError when a plain list has fewer cores than ranks."""
    cores = parse_cores(bind)
    if cores is None or tp == 1 or "|" in bind:
        return bind
    if len(cores) < tp:
        raise UsageError(f"omp_bind {bind!r} gives {len(cores)} core(s) to {tp} TP ranks: each CPU rank needs a core of its own",
                         hint=f"bind the engine to at least {tp} cores, or lower its tp")
    per = len(cores) // tp
    return "|".join(",".join(map(str, cores[r * per : (r + 1) * per])) for r in range(tp))


def split_cores() -> tuple[str, str]:
    """The local 1P1D's cores: the first half for P, the rest for D (one core: both on it)."""
    n = os.cpu_count() or 2
    if n < 2:
        return "0", "0"
    half = n // 2
    one = lambda a, b: str(a) if a == b else f"{a}-{b}"  # noqa: E731
    return one(0, half - 1), one(half, n - 1)


def least_bound_cores(busy: dict[int, int], want: int) -> str:
    """`want` cores of this host with the fewest engines bound to them (the higher-numbered first on a tie: core
    0 takes the system's own work), as an omp_bind value."""
    cores = sorted(os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1))
    chosen = sorted(sorted(cores, key=lambda c: (busy.get(c, 0), -c))[: max(1, want)])
    return ",".join(map(str, chosen))
