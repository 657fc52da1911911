"""A `pdkv bench` run from its command-line options: `pdkv bench` (typer) and `python -m pdkv.bench`
(argparse, for hosts without the CLI's dependencies) both call `spec_from_options`, so every check
and default of an option lives here once.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdkv.bench.layout import expand_layouts, parse_sweep
from pdkv.bench.runner import BenchSpec, settings_from_env
from pdkv.errors import StartError, UsageError
from pdkv.geometry import geometry_from_options, parse_tp_pair
from pdkv.peer_address import advertised_address
from pdkv.transport import MAX_SOCKET_CONNECTIONS, socket_buffer_problem


def parse_settings(items: Sequence[str]) -> dict[str, str]:
    """`--mc MC_NAME=VALUE` items as a dict."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise UsageError(f"cannot read --mc {item!r}", hint="write it as MC_NAME=VALUE, e.g. --mc MC_TCP_SLICE_SIZE=1048576")
        out[key.strip()] = value.strip()
    return out


def address_towards(target: str) -> str:
    """This host's address for the server at `target` (HOST:PORT) to reach (pdkv.peer_address, towards it);
    loopback on a host with none."""
    try:
        return advertised_address(towards=target.rsplit(":", 1)[0].strip("[]"))
    except StartError:
        return "127.0.0.1"


def check_socket_options(transport: str, connections: int, socket_buffer: int | None) -> None:
    """--connections and --socket-buffer: the socket transport's, in its ranges."""
    given = [flag for flag, is_set in (("--connections", connections != 0), ("--socket-buffer", socket_buffer is not None)) if is_set]
    if given and transport != "socket":
        raise UsageError(f"{' and '.join(given)}: the socket transport's settings, and the transport is {transport}",
                         hint="add --transport socket, or leave them out")
    if not 0 <= connections <= MAX_SOCKET_CONNECTIONS:
        raise UsageError(f"--connections must be 0..{MAX_SOCKET_CONNECTIONS}, got {connections}", hint="0 takes the cores, at most 4")
    if socket_buffer is not None and (problem := socket_buffer_problem(socket_buffer)):
        raise UsageError(f"--socket-buffer {problem}", hint="leave it out for the transport's 96 KiB")


def check_target(target: str) -> None:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise UsageError(f"--target {target!r} is not HOST:PORT", hint="use the address `pdkv bench serve` printed")


def spec_from_options(
    *,
    model: str | None = None,
    layers: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    dtype: str | None = None,
    block_size: int = 16,
    blocks: int = 63,
    layout: Sequence[str] = ("contiguous",),
    sweep: Sequence[str] = (),
    transport: str = "tcp",
    device: str = "",
    src: str = "cpu",
    dst: str = "cpu",
    iters: int = 20,
    warmup: int = 2,
    seed: int = 0,
    link_gbps: float | None = None,
    baseline: bool = False,
    target: str | None = None,
    hostname: str | None = None,
    mc: Sequence[str] = (),
    tp: str = "1",
    connections: int = 0,
    socket_buffer: int | None = None,
) -> BenchSpec:
    """The BenchSpec of `pdkv bench` given these options (named as its flags are, `--kv-heads` as
    `kv_heads`); raises UsageError for options that cannot be used."""
    p_tp, d_tp = parse_tp_pair(tp)
    # Equal TP: one rank's share of the model, moved whole; unequal: the whole model, D rank 0's heads from each P rank.
    geometry = geometry_from_options(model, layers, kv_heads, head_dim, dtype, p_tp if p_tp == d_tp else 1)
    swept = parse_sweep(sweep)
    if target is not None:
        check_target(target)
    check_socket_options(transport, connections, socket_buffer)
    return BenchSpec(
        geometry=geometry,
        block_size=block_size,
        blocks=swept.get("blocks", [blocks]),
        layouts=swept.get("layout", expand_layouts(layout)),
        transport=transport,
        device=device,
        hostname=hostname or (address_towards(target) if target else "127.0.0.1"),
        src=src,
        dst=dst,
        iters=iters,
        warmup=warmup,
        seed=seed,
        link_gbps=link_gbps,
        baseline=baseline,
        target=target,
        settings=settings_from_env(parse_settings(mc)),
        tp=(1, 1) if p_tp == d_tp else (p_tp, d_tp),
        connections=connections,
        socket_buffer_bytes=socket_buffer,
    )
