"""Pieces of the parts' command lines that `pdkv up` (pdkv.deploy.plan.topology) and `pdkv k8s render` (pdkv.k8s) share. Pure."""

from __future__ import annotations

from pdkv.deploy.plan.schema import AutoscaleEntry, Deployment
from pdkv.errors import ConfigError


def bootstrap_args(host: str, port: int) -> list[str]:
    """`pdkv bootstrap`'s arguments for a standalone server (here and in Kubernetes, pdkv.k8s)."""
    return ["bootstrap", "--host", host, "--port", str(port)]


def proxy_args(dep: Deployment, host: str) -> list[str]:
    """`pdkv proxy`'s arguments before its backends (--prefill/--decode, or --members) and the file's extra_args."""
    assert dep.proxy is not None
    argv = ["proxy", "--host", host, "--port", str(dep.proxy.port), "--connector", dep.connector]
    if dep.proxy.policy is not None:
        argv += ["--policy", dep.proxy.policy]
    if dep.proxy.local_prefill_tokens is not None:
        argv += ["--local-prefill-tokens", str(dep.proxy.local_prefill_tokens)]
    return argv


def planner_args(a: AutoscaleEntry) -> list[str]:
    """`pdkv proxy`'s flags that run the planner's signal with `[autoscale]`'s targets, bounds and waits."""
    return ["--planner-profile", a.profile, "--slo", f"ttft={a.ttft_ms:g},itl={a.itl_ms:g}", "--slo-quantile", f"{a.quantile:g}",
            "--planner-interval", f"{a.interval_s:g}",
            "--planner-bounds", f"prefill={a.prefill.min}:{a.prefill.max},decode={a.decode.min}:{a.decode.max}",
            "--planner-waits", f"up={a.up_after_s:g},down={a.down_after_s:g},margin={a.down_margin:g}"]


def check_one_instance_per_table(dep: Deployment) -> None:
    """`pdkv up` starts each [[prefill]]/[[decode]] table once; `replicas` above 1 is Kubernetes' (pdkv k8s render)."""
    for role, entries in (("prefill", dep.prefill), ("decode", dep.decode)):
        for i, e in enumerate(entries):
            if e.replicas != 1:
                raise ConfigError(
                    f"[[{role}]] {i + 1} has replicas = {e.replicas}: pdkv up starts one engine per table",
                    hint="write one table per engine (each its own port and GPU), or render it for Kubernetes: pdkv k8s render -f FILE",
                )
