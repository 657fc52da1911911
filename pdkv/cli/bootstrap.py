"""`pdkv bootstrap`: run the engine registry; `query` and `deregister` talk to a running one."""

from __future__ import annotations

import logging
import os
import sys

import typer
from rich.table import Table

from pdkv.auth import token_from_env
from pdkv.bootstrap import DEFAULT_PORT, PORT_ENV, TOKEN_ENV
from pdkv.cli.options import JsonOpt
from pdkv.cli.output import console, err_console, print_json

HELP = f"""Run the bootstrap server: the registry where prefill workers register their
side-channel addresses and decode engines look them up. Speaks vLLM's
MooncakeBootstrapServer protocol; point vLLM at it with
kv_connector_extra_config.bootstrap_server_address = "HOST:PORT".

The port defaults to ${PORT_ENV}, else {DEFAULT_PORT}. With --token (or
${TOKEN_ENV}, the deployment key) only callers with the key may register or
deregister.

Examples:

  pdkv bootstrap --host 0.0.0.0 --port 8998

  pdkv bootstrap --port 0 --json

  PDKV_TOKEN=s3cret pdkv bootstrap --host 10.0.0.2

  pdkv bootstrap query http://10.0.0.2:8998

  pdkv bootstrap deregister 5b1e0c7a-prefill --url http://10.0.0.2:8998 --token s3cret
"""

QUERY_HELP = """Print every prefill engine a bootstrap server knows, by DP rank.

Examples:

  pdkv bootstrap query

  pdkv bootstrap query http://10.0.0.2:8998 --json
"""

DEREGISTER_HELP = """Remove every entry of ENGINE_ID, freeing its DP ranks for a restarted engine.

Examples:

  pdkv bootstrap deregister 5b1e0c7a-prefill

  pdkv bootstrap deregister 5b1e0c7a-prefill --url http://10.0.0.2:8998 --token s3cret --json
"""

bootstrap_app = typer.Typer(help=HELP, no_args_is_help=False, invoke_without_command=True)

TokenOpt = typer.Option(
    None, "--token", envvar=TOKEN_ENV, help="The deployment key: needed on every write endpoint.",
    show_envvar=True,
)


def _default_url() -> str:
    return f"http://127.0.0.1:{os.environ.get(PORT_ENV, DEFAULT_PORT)}"


def _client(url: str | None, token: str | None, timeout: float, retries: int):
    from pdkv.bootstrap import BootstrapClient

    return BootstrapClient(url or _default_url(), timeout=timeout, retries=retries, token=token)


def _connectable(host: str) -> str:
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


@bootstrap_app.callback(invoke_without_command=True)
def serve(
    ctx: typer.Context,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on (0.0.0.0 for every interface)."),
    port: int = typer.Option(DEFAULT_PORT, "--port", envvar=PORT_ENV, min=0, max=65535, help="Port; 0 picks a free one.", show_envvar=True),
    token: str | None = TokenOpt,
    probe_interval: float = typer.Option(10.0, "--probe-interval", min=0, help="Seconds between liveness sweeps; 0 turns them off."),
    probe_failures: int = typer.Option(3, "--probe-failures", min=1, help="Failed sweeps in a row before an engine is dropped."),
    probe_timeout: float = typer.Option(0.5, "--probe-timeout", min=0.01, help="Seconds one side-channel probe may take."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Log only warnings (registrations are logged otherwise)."),
    json_out: JsonOpt = False,
) -> None:
    if ctx.invoked_subcommand is not None:
        return
    import msgspec

    token = token or token_from_env()  # None, or a ConfigError for a key under a name pdkv does not read

    from pdkv.bootstrap import ProbePolicy, run_server

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("pdkv.bootstrap")

    def ready(bound_host: str, bound_port: int) -> None:
        logger.addHandler(handler)
        logger.setLevel(logging.WARNING if quiet else logging.INFO)
        url = f"http://{_connectable(bound_host)}:{bound_port}"
        if json_out:
            line = {"url": url, "host": bound_host, "port": bound_port, "token": bool(token), "pid": os.getpid()}
            sys.stdout.write(msgspec.json.encode(line).decode() + "\n")
            sys.stdout.flush()
            return
        sweep = f"every {probe_interval:g} s" if probe_interval > 0 else "off"
        needed = "required" if token else "not required"
        console.print(f"pdkv bootstrap listening on [bold]{url}[/] (token {needed}; liveness sweep {sweep})")
        console.print(f"  vLLM: kv_connector_extra_config.bootstrap_server_address = \"{_connectable(bound_host)}:{bound_port}\"")
        console.print("  stop with Ctrl-C")

    probe = ProbePolicy(timeout=probe_timeout, interval=probe_interval, failures=probe_failures)
    try:
        run_server(host, port, token=token, probe=probe, on_ready=ready)
    finally:
        logger.removeHandler(handler)
    if not json_out:
        err_console.print("pdkv bootstrap stopped")


@bootstrap_app.command("query", help=QUERY_HELP)
def query(
    url: str = typer.Argument(None, help="Bootstrap server URL \\[default: http://127.0.0.1:$VLLM_MOONCAKE_BOOTSTRAP_PORT or 8998]."),
    timeout: float = typer.Option(2.0, "--timeout", min=0.01, help="Seconds per attempt."),
    retries: int = typer.Option(3, "--retries", min=0, help="Further attempts after a failed one."),
    json_out: JsonOpt = False,
) -> None:
    with _client(url, None, timeout, retries) as client:
        engines = client.query()
        where = client.url
    if json_out:
        print_json({str(dp): entry for dp, entry in engines.items()})
        return
    if not engines:
        console.print(f"no prefill engine is registered at {where}")
        return
    table = Table(title=f"prefill engines at {where}")
    for column in ("dp", "engine_id", "tp", "pp", "side channel"):
        table.add_column(column)
    for dp, entry in engines.items():
        for tp, pps in sorted(entry.worker_addr.items(), key=lambda kv: int(kv[0])):
            for pp, addr in sorted(pps.items(), key=lambda kv: int(kv[0])):
                table.add_row(str(dp), entry.engine_id, tp, pp, addr)
    console.print(table)


@bootstrap_app.command("deregister", help=DEREGISTER_HELP)
def deregister(
    engine_id: str = typer.Argument(..., help="The engine whose entries go."),
    url: str = typer.Option(
        None, "--url", help="Bootstrap server URL \\[default: http://127.0.0.1:$VLLM_MOONCAKE_BOOTSTRAP_PORT or 8998]."
    ),
    token: str | None = TokenOpt,
    timeout: float = typer.Option(2.0, "--timeout", min=0.01, help="Seconds per attempt."),
    retries: int = typer.Option(3, "--retries", min=0, help="Further attempts after a failed one."),
    json_out: JsonOpt = False,
) -> None:
    with _client(url, token or token_from_env(), timeout, retries) as client:
        removed = client.deregister(engine_id)
        where = client.url
    if json_out:
        print_json({"engine_id": engine_id, "removed": removed, "url": where})
        return
    if removed:
        console.print(f"removed engine {engine_id!r} ({removed} worker address{'es' * (removed != 1)}) from {where}")
    else:
        console.print(f"engine {engine_id!r} was not registered at {where}; nothing removed")


def register(app: typer.Typer) -> None:
    app.add_typer(bootstrap_app, name="bootstrap")
