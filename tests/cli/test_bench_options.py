"""`pdkv bench` and `python -m pdkv.bench` take the same options, turned into a BenchSpec by one function."""

from __future__ import annotations

import inspect

import pytest
import typer.main

from pdkv.bench.__main__ import parser_for
from pdkv.bench.options import spec_from_options
from pdkv.cli.app import build_app
from pdkv.errors import UsageError

TINY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "32"]


def _plain(value):
    return list(value) if isinstance(value, tuple | list) else value


def test_the_cli_offers_every_option_with_the_librarys_default():
    bench = typer.main.get_command(build_app()).commands["bench"]
    cli = {p.name: p.default for p in bench.params}
    for name, param in inspect.signature(spec_from_options).parameters.items():
        assert name in cli, f"pdkv bench has no --{name.replace('_', '-')}"
        assert _plain(cli[name]) == _plain(param.default), name


def test_python_m_pdkv_bench_builds_the_same_spec_as_the_library():
    argv = [*TINY, "--blocks", "4", "--layout", "contiguous", "--layout", "scattered", "--mc", "MC_X=1", "--baseline", "--json"]
    options = vars(parser_for(spec_from_options, "python -m pdkv.bench").parse_args(argv))
    options.pop("json")
    spec = spec_from_options(**options)
    assert spec == spec_from_options(layers=2, kv_heads=2, head_dim=32, blocks=4, layout=["contiguous", "scattered"],
                                     mc=["MC_X=1"], baseline=True)  # fmt: skip
    assert spec.layouts == ["contiguous", "scattered"] and spec.settings["MC_X"] == "1" and spec.iters == 20


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "no model geometry given"),
        ({"layers": 2, "kv_heads": 2, "head_dim": 32, "target": "nowhere"}, "not HOST:PORT"),
        ({"layers": 2, "kv_heads": 2, "head_dim": 32, "mc": ["MC_X"]}, "cannot read --mc"),
        ({"layers": 2, "kv_heads": 2, "head_dim": 32, "connections": 2}, "--connections: the socket transport's settings"),
        ({"layers": 2, "kv_heads": 2, "head_dim": 32, "socket_buffer": 0}, "--socket-buffer: the socket transport's"),
        ({"layers": 2, "kv_heads": 2, "head_dim": 32, "transport": "socket", "connections": 65}, r"--connections must be 0\.\.64"),
        ({"layers": 2, "kv_heads": 2, "head_dim": 32, "transport": "socket", "socket_buffer": 1000}, "--socket-buffer must be 0"),
    ],
)
def test_unusable_options_are_usage_errors(options, message):
    with pytest.raises(UsageError, match=message):
        spec_from_options(**options)
