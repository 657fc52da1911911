"""Reading a deployment file: TOML in, a validated `Deployment` (pdkv.deploy.plan.schema) out, every problem one
ConfigError naming the file.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import msgspec

from pdkv.connector import DEFAULT_LAYER_GROUPS, layer_groups_problem
from pdkv.deploy.plan.fleet import check_hosts
from pdkv.deploy.plan.schema import MIN_CPU_KV_CACHE_BYTES, Deployment
from pdkv.errors import ConfigError
from pdkv.transport import MAX_SOCKET_CONNECTIONS, TRANSPORTS, socket_buffer_problem


def load_deployment(path: str | Path) -> Deployment:
    """Read and validate a deploy.toml; every problem is a ConfigError naming the file."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no deployment file at {path}", hint="pass -f deploy.toml (see examples/deploy.toml)") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None
    return deployment_from_dict(data, source=str(path))


def deployment_from_dict(data: dict[str, Any], *, source: str = "deployment") -> Deployment:
    if "protocol" in data:  # the key's earlier name: refused by name, never read in its place
        raise ConfigError(f"{source}: the key `protocol` is now `transport`",
                          hint=f'write transport = "{data["protocol"]}" (one of: {", ".join(TRANSPORTS)})')
    try:
        dep = msgspec.convert(data, Deployment)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{source}: {exc}", hint="see examples/deploy.toml for the fields") from None
    if not dep.prefill or not dep.decode:
        raise ConfigError(f"{source}: a deployment needs at least one [[prefill]] and one [[decode]]")
    for role, entries in (("prefill", dep.prefill), ("decode", dep.decode)):
        for i, e in enumerate(entries):
            if e.replicas < 1:
                raise ConfigError(f"{source}: [[{role}]] {i + 1} has replicas = {e.replicas}", hint="write 1 or more")
    if dep.bootstrap.mode == "external" and not dep.bootstrap.url:
        raise ConfigError(f"{source}: bootstrap mode 'external' needs url = \"http://HOST:PORT\"")
    if dep.cpu_kv_cache_bytes is not None and dep.cpu_kv_cache_bytes < MIN_CPU_KV_CACHE_BYTES:
        raise ConfigError(f"{source}: cpu_kv_cache_bytes must be at least {MIN_CPU_KV_CACHE_BYTES:,} (1 MiB), got {dep.cpu_kv_cache_bytes}",
                          hint="leave it out for 1 GiB a CPU engine")
    if dep.autoscale is not None:
        _check_autoscale(dep, source)
    _check_socket(dep, source)
    check_hosts(dep, source=source)
    return dep


def _check_socket(dep: Deployment, source: str) -> None:
    """The socket transport's settings, refused here rather than by each engine's connector once it starts."""
    if not 0 <= dep.socket_connections <= MAX_SOCKET_CONNECTIONS:
        raise ConfigError(f"{source}: socket_connections must be 0..{MAX_SOCKET_CONNECTIONS}, got {dep.socket_connections}",
                          hint="0 takes the worker's cores, at most 4 (docs/socket.md)")
    if dep.socket_buffer_bytes is not None and (problem := socket_buffer_problem(dep.socket_buffer_bytes)):
        raise ConfigError(f"{source}: socket_buffer_bytes {problem}", hint="leave it out for the transport's 96 KiB (docs/socket.md)")
    if dep.socket_write_layers and dep.transport != "socket":
        raise ConfigError(f"{source}: socket_write_layers needs transport = \"socket\", not {dep.transport!r}",
                          hint="over Mooncake tcp a layer-by-layer write slowed P's forward (docs/bench.md); leave it out")
    if dep.socket_send_process and dep.transport != "socket":
        raise ConfigError(f"{source}: socket_send_process needs transport = \"socket\", not {dep.transport!r}",
                          hint="leave it out: only the socket transport's P writes from a process of its own")
    if problem := layer_groups_problem(dep.socket_layer_groups):
        raise ConfigError(f"{source}: socket_layer_groups {problem}",
                          hint=f"leave it out for {DEFAULT_LAYER_GROUPS} writes a forward (docs/socket.md)")


def _check_autoscale(dep: Deployment, source: str) -> None:
    a = dep.autoscale
    assert a is not None
    for role, bounds, listed in (("prefill", a.prefill, dep.prefill), ("decode", a.decode, dep.decode)):
        if not 1 <= bounds.min <= bounds.max:
            raise ConfigError(f"{source}: [autoscale.{role}] needs 1 <= min <= max, got min = {bounds.min}, max = {bounds.max}")
        # The engines the role starts with: one per table under `pdkv up` (it refuses replicas above 1), `replicas` each
        # in Kubernetes, where one table with replicas = N is N engines of one workload.
        engines = sum(e.replicas for e in listed)
        if not bounds.min <= engines <= bounds.max:
            raise ConfigError(f"{source}: {engines} {role} engines ([[{role}]] tables x replicas) lie outside "
                              f"[autoscale.{role}]'s {bounds.min}..{bounds.max}",
                              hint="list the engines a deployment starts with; the planner adds and removes within the bounds")  # fmt: skip
    if a.ttft_ms <= 0 or a.itl_ms <= 0 or not 0 < a.quantile < 1:
        raise ConfigError(f"{source}: [autoscale] needs ttft_ms > 0, itl_ms > 0 and 0 < quantile < 1")
    if a.interval_s <= 0 or a.up_after_s < 0 or a.down_after_s < 0 or a.drain_timeout_s <= 0 or not 0 < a.down_margin <= 1:
        raise ConfigError(f"{source}: [autoscale] needs interval_s > 0, up_after_s >= 0, down_after_s >= 0, drain_timeout_s > 0 "
                          "and 0 < down_margin <= 1")  # fmt: skip
