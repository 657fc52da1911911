"""`python -m pdkv.bench`: the benchmark without the typer CLI, for hosts that carry only pdkv's core deps
(scripts/device_bench.sh falls back to it where `pdkv` does not load).

Its flags are the parameters of pdkv.bench.options.spec_from_options, the function `pdkv bench` calls
too, named the same way (`kv_heads` is `--kv-heads`, a sequence is a repeatable flag); checks and
defaults are that function's. It always prints the JSON report (`--json` is accepted for symmetry).
Exit codes follow pdkv.errors: 1 failed (including corrupted bytes), 2 usage, 3 could not start.
"""

from __future__ import annotations

import argparse
import inspect
import sys
import typing
from collections.abc import Callable
from typing import Any

import msgspec

from pdkv.errors import PdkvError


def parser_for(fn: Callable[..., Any], prog: str) -> argparse.ArgumentParser:
    """An argparse parser with one flag per keyword parameter of `fn`; only the flags given are parsed,
    so `fn`'s own defaults apply."""
    p = argparse.ArgumentParser(prog=prog, description=__doc__, argument_default=argparse.SUPPRESS)
    hints = typing.get_type_hints(fn)
    for name, param in inspect.signature(fn).parameters.items():
        flag = "--" + name.replace("_", "-")
        kind = hints[name]
        if type(None) in typing.get_args(kind):  # X | None: the flag takes an X
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        if kind is bool:
            p.add_argument(flag, action="store_true")
        elif typing.get_origin(kind) is not None:  # Sequence[str]
            p.add_argument(flag, action="append", type=typing.get_args(kind)[0], help=f"repeatable [default: {param.default!r}]")
        else:
            p.add_argument(flag, type=kind, help=f"[default: {param.default!r}]")
    p.add_argument("--json", action="store_true", help="accepted for symmetry with `pdkv bench`; output is always JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    from pdkv.bench.options import spec_from_options
    from pdkv.bench.runner import run_bench

    options = vars(parser_for(spec_from_options, "python -m pdkv.bench").parse_args(argv))
    options.pop("json", None)
    try:
        report = run_bench(spec_from_options(**options))
    except PdkvError as exc:
        print(f"pdkv bench: error: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return int(exc.exit_code)
    sys.stdout.write(msgspec.json.encode(report).decode() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
