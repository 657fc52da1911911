"""The typer app: every command registered in one list, errors mapped to exit codes.

Each module named in COMMANDS exposes `register(app)`. Modules import only
typer, rich and light parts of pdkv at import time, so `pdkv --help` is instant.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from collections.abc import Sequence

import typer

try:  # typer >= 0.29 vendors click
    from typer._click import exceptions as click_exc
except ImportError:  # pragma: no cover - older typer uses click itself
    from click import exceptions as click_exc

from pdkv import __version__
from pdkv.errors import ExitCode, PdkvError

# One module per command, in the order `pdkv --help` lists them.
COMMANDS: list[str] = [
    "plan",
    "profile",
    "simulate",
    "model",
    "bootstrap",
    "proxy",
    "doctor",
    "up",
    "down",
    "k8s",
    "status",
    "top",
    "bench",
    "trace",
]

HELP = """Run prefill/decode (P/D) disaggregated vLLM serving.

Examples:

  pdkv plan --model ./Qwen3-8B --prompt-tokens 1000 --output-tokens 128

  pdkv profile --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 -o my.profile.json

  pdkv plan --profile my.profile.json --rate 20 --prompt-tokens 1000 --output-tokens 128 --slo ttft=500,itl=50

  pdkv simulate --profile my.profile.json --slo ttft=500,itl=50 --peak-rate 200 --prompt-tokens 200-2000

  pdkv model tiny ./tiny-model

  pdkv bootstrap --host 0.0.0.0 --port 8998

  pdkv proxy --prefill http://10.0.0.2:8100 --decode http://10.0.0.3:8200

  pdkv doctor --device mlx5_0

  pdkv up                                # a local 1P1D: bootstrap, prefill, decode, proxy

  pdkv down                              # stop it, from another terminal

  pdkv k8s render -f examples/k8s-1p1d.toml -o k8s/   # Kubernetes manifests of a deployment file

  pdkv status --proxy http://127.0.0.1:8000

  pdkv top --proxy http://127.0.0.1:8000         # the live view: engines, requests, TTFT, transfers

  pdkv bench --model ./Qwen3-8B --blocks 63 --layout all --baseline

  pdkv trace --proxy http://127.0.0.1:8000 --html trace.html
"""


def _version(value: bool) -> None:
    if value:
        typer.echo(f"pdkv {__version__}")
        raise typer.Exit()


def build_app() -> typer.Typer:
    app = typer.Typer(
        name="pdkv",
        help=HELP,
        no_args_is_help=True,
        add_completion=False,  # completions/ holds static scripts
        pretty_exceptions_enable=False,
        rich_markup_mode="rich",
        context_settings={"help_option_names": ["-h", "--help"]},
    )

    @app.callback()
    def _root(
        version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
    ) -> None:
        """Run prefill/decode (P/D) disaggregated vLLM serving."""

    for name in COMMANDS:
        importlib.import_module(f"pdkv.cli.{name}").register(app)
    return app


def report_error(exc: PdkvError) -> None:
    print(f"pdkv: error: {exc.message}", file=sys.stderr)
    if exc.hint:
        print(f"  hint: {exc.hint}", file=sys.stderr)
    if os.environ.get("PDKV_DEBUG") == "1":
        traceback.print_exception(exc, file=sys.stderr)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the CLI with `argv` and return its exit code instead of exiting."""
    app = build_app()
    command = typer.main.get_command(app)
    try:
        result = command.main(args=list(argv) if argv is not None else None, prog_name="pdkv", standalone_mode=False)
    except PdkvError as exc:
        report_error(exc)
        return int(exc.exit_code)
    except typer.Exit as exc:
        return int(exc.exit_code)
    except typer.Abort:
        print("pdkv: aborted", file=sys.stderr)
        return 130
    except click_exc.ClickException as exc:
        exc.show()
        return int(ExitCode.USAGE) if isinstance(exc, click_exc.UsageError) else int(exc.exit_code)
    except KeyboardInterrupt:
        print("pdkv: interrupted", file=sys.stderr)
        return 130
    return int(result) if isinstance(result, int) else 0


def main() -> None:
    sys.exit(run())
