"""`pdkv bench`: KV transfer measured through pdkv's own transport and planner.

`layout` (pure: block ids per layout, sweeps, statistics), `memory` (per-layer
KV buffers on cpu or cuda:N), `control` (the decode side and its ZMQ control
channel), `baseline` (bare TransferEngine calls, transfer_engine_bench),
`runner` (run_bench: one report for every case), `options` (the BenchSpec of
`pdkv bench`'s options, for the CLI and `python -m pdkv.bench` alike).
"""

from pdkv.bench.control import BenchTarget
from pdkv.bench.options import check_socket_options, parse_settings, spec_from_options
from pdkv.bench.runner import BenchReport, BenchSpec, run_bench, settings_from_env

__all__ = [
    "BenchReport",
    "BenchSpec",
    "BenchTarget",
    "check_socket_options",
    "parse_settings",
    "run_bench",
    "settings_from_env",
    "spec_from_options",
]
