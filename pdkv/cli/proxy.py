"""`pdkv proxy`: the P/D router in front of prefill and decode vLLM servers."""

from __future__ import annotations

import enum
import logging
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from pdkv.cli.options import JsonOpt
from pdkv.cli.output import console, err_console

HELP = """Route OpenAI completions to a prefill and a decode server at once.

Each request goes to a prefill server (max_tokens 1, min_tokens 1, no stop
strings, so it always hands its KV over) and to a decode server (the client's
own request, told which prefill engine holds its KV). Several of each;
backends that fail health checks are taken out and put back. /health, /metrics
(Prometheus), /v1/models, and per-request timings at /pdkv/requests/ID.

Examples:

  pdkv proxy --prefill http://10.0.0.2:8100 --decode http://10.0.0.3:8200

  pdkv proxy -p http://p1:8100,http://p1:8998 -p http://p2:8100 -d http://d1:8200 -d http://d2:8200

  pdkv proxy -p http://p1:8100 -d http://d1:8200 --policy least-outstanding --port 9000

  pdkv proxy -p http://p1:8100 -d http://d1:8200 --no-local-fallback   # a dead P is the client's error

  pdkv proxy -p http://p1:8100 -d http://d1:8200 --connector mooncake   # engines run vLLM's MooncakeConnector

  pdkv proxy --members http://10.0.0.1:8998   # route to whatever engines join that bootstrap's registry

  pdkv proxy -p http://p1:8100 -d http://d1:8200 --policy kv-aware --kv-events http://p1:8100=tcp://p1:5557 --kv-events http://d1:8200=tcp://d1:5559

  pdkv proxy --config proxy.toml --port 9000 --json

  pdkv proxy --members http://10.0.0.1:8998 --planner-profile tiny.profile.json --slo ttft=2000,itl=50 --planner-bounds prefill=1:4

  PDKV_API_KEY=sk-1 PDKV_ADMIN_KEY=adm pdkv proxy -p http://p1:8100 -d http://d1:8200 --host 0.0.0.0

  pdkv proxy -p http://p1:8100 -d http://d1:8200 --ssl-certfile cert.pem --ssl-keyfile key.pem

With --api-key (or --api-key-file, or $PDKV_API_KEY) /v1/* needs `Authorization:
Bearer KEY`, as vLLM's --api-key; with --admin-key (or $PDKV_ADMIN_KEY) /pdkv/* and
/metrics need the admin key. Bodies over 64 MiB answer 413, oversized headers 431.

With --planner-profile and --slo the proxy runs the planner's signal (docs/planner.md): every
--planner-interval seconds the P and D counts the targets need, from what it observed, as the
pdkv_planner_* gauges on /metrics and as JSON at GET /pdkv/planner (what `pdkv up -f` with an
\\[autoscale] table acts on). A config file may hold the same as a \\[planner] table.
"""


class ConnectorChoice(str, enum.Enum):
    pdkv = "pdkv"
    mooncake = "mooncake"


class PolicyChoice(str, enum.Enum):
    round_robin = "round-robin"
    least_outstanding = "least-outstanding"
    kv_aware = "kv-aware"


def _read_config(path: Path | None) -> dict:
    if path is None:
        return {}
    import tomllib

    from pdkv.errors import ConfigError

    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def proxy(
    prefill: Annotated[
        list[str] | None,
        typer.Option(
            "--prefill", "-p", metavar="URL[,BOOTSTRAP]",
            help="Prefill server URL[,BOOTSTRAP_URL or port]; repeatable. "
            "Bootstrap defaults to the same host on $VLLM_MOONCAKE_BOOTSTRAP_PORT or 8998.",
        ),
    ] = None,
    decode: Annotated[list[str] | None, typer.Option("--decode", "-d", metavar="URL", help="Decode server URL; repeatable.")] = None,
    members: Annotated[
        list[str] | None,
        typer.Option(
            "--members", "-m", metavar="BOOTSTRAP_URL",
            help="Follow this bootstrap server's members registry: engines that join it are routed to, engines that "
            "leave are not; repeatable, beside or instead of --prefill/--decode.",
        ),
    ] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML file with prefill = [...], decode = [...] and any option below.")
    ] = None,
    policy: Annotated[
        PolicyChoice | None,
        typer.Option("--policy", help="How to pick among backends; kv-aware: by where each prompt's KV blocks are cached "
                     "(engines' KV events, see --kv-events). \\[default: round-robin]"),
    ] = None,
    kv_events: Annotated[
        list[str] | None,
        typer.Option("--kv-events", metavar="URL=tcp://HOST:PORT[,REPLAY]",
                     help="Where the engine at URL publishes its KV cache events (replay defaults to PORT+1); repeatable. "
                     "kv-aware only."),
    ] = None,
    local_prefill_tokens: Annotated[
        int | None,
        typer.Option("--local-prefill-tokens", min=0,
                     help="kv-aware: D computes the prompt alone, skipping P and the transfer, when it lacks at most this many "
                     "of its tokens; 0: never. \\[default: 128]"),
    ] = None,
    tokenizer: Annotated[
        Path | None,
        typer.Option("--tokenizer", help="kv-aware: the model's folder (tokenizer.json, tokenizer_config.json): the proxy tokenizes "
                     "prompts itself instead of asking an engine's /tokenize (checked against the engines at start-up)."),
    ] = None,
    kv_queue_weight: Annotated[
        float | None,
        typer.Option("--kv-queue-weight", min=0.0, help="kv-aware: weight of P's queued prefill tokens against the tokens a "
                     "request would compute there. \\[default: 1]"),
    ] = None,
    connector: Annotated[
        ConnectorChoice | None,
        typer.Option("--connector", help="The KV connector the engines run (vLLM's mooncake: n > 1 is refused). \\[default: pdkv]"),
    ] = None,
    local_fallback: Annotated[
        bool | None,
        typer.Option(
            "--local-fallback/--no-local-fallback",
            help="With no prefill engine up, or P failing before D's KV could come, D computes the prompt itself "
            "instead of the client getting an error. \\[default: on]",
        ),
    ] = None,
    host: Annotated[str | None, typer.Option("--host", help="Address to listen on. \\[default: 127.0.0.1]")] = None,
    port: Annotated[int | None, typer.Option("--port", help="Port to listen on. \\[default: 8000]")] = None,
    connect_timeout: Annotated[
        float | None, typer.Option("--connect-timeout", help="Seconds to connect to a backend. \\[default: 5]")
    ] = None,
    prefill_timeout: Annotated[
        float | None, typer.Option("--prefill-timeout", help="Seconds for P's whole answer. \\[default: 120]")
    ] = None,
    decode_timeout: Annotated[
        float | None, typer.Option("--decode-first-byte-timeout", help="Seconds until D's first byte. \\[default: 180]")
    ] = None,
    health_interval: Annotated[
        float | None, typer.Option("--health-interval", help="Seconds between health rounds. \\[default: 5]")
    ] = None,
    api_key: Annotated[
        list[str] | None, typer.Option("--api-key", help="An API key clients must present on /v1/*; repeatable. Env: PDKV_API_KEY.")
    ] = None,
    api_key_file: Annotated[Path | None, typer.Option("--api-key-file", help="File of API keys, one a line.")] = None,
    admin_key: Annotated[
        str | None, typer.Option("--admin-key", help="Key for /pdkv/* and /metrics. Env: PDKV_ADMIN_KEY.", show_default=False)
    ] = None,
    ssl_certfile: Annotated[Path | None, typer.Option("--ssl-certfile", help="Serve TLS with this certificate (PEM).")] = None,
    ssl_keyfile: Annotated[Path | None, typer.Option("--ssl-keyfile", help="The certificate's private key (PEM).")] = None,
    planner_profile: Annotated[
        Path | None, typer.Option("--planner-profile", help="Run the planner's signal on this profile (from `pdkv profile`); needs --slo.")
    ] = None,
    slo: Annotated[str | None, typer.Option("--slo", metavar="ttft=MS,itl=MS", help="The planner's latency targets.")] = None,
    slo_quantile: Annotated[float | None, typer.Option("--slo-quantile", help="The targets' quantile. \\[default: 0.9]")] = None,
    planner_interval: Annotated[
        float | None, typer.Option("--planner-interval", help="Seconds between the planner's rounds. \\[default: 5]")
    ] = None,
    planner_window: Annotated[
        float | None, typer.Option("--planner-window", help="Seconds of requests each round observes. \\[default: 30]")
    ] = None,
    planner_bounds: Annotated[
        str | None, typer.Option("--planner-bounds", metavar="prefill=MIN:MAX,decode=MIN:MAX", help="Engines the planner may ask for.")
    ] = None,
    planner_waits: Annotated[
        str | None, typer.Option("--planner-waits", metavar="up=S,down=S,margin=F",
                                 help="Hysteresis: how long a larger need lasts before it is asked for (0), how long a smaller "
                                 "count suffices before engines are let go (60), and the share of the targets it must predict (0.8).")
    ] = None,
    json_out: JsonOpt = False,
) -> None:
    from pdkv.proxy import build_config, load_guard, planner_values, serve, server_ssl
    from pdkv.errors import UsageError

    guard = load_guard(api_key, api_key_file, admin_key)
    ssl_ctx = server_ssl(ssl_certfile, ssl_keyfile)

    file_values = _read_config(config)
    kv = dict(file_values.get("kv") or {})
    if kv_events:
        kv["events"] = kv_events
    if local_prefill_tokens is not None:
        kv["local_prefill_tokens"] = local_prefill_tokens
    if kv_queue_weight is not None:
        kv["queue_weight"] = kv_queue_weight
    if tokenizer is not None:
        kv["tokenizer"] = str(tokenizer)
    planner = dict(file_values.get("planner") or {})
    if planner_profile is not None or slo is not None:
        if planner_profile is None or slo is None:
            raise UsageError("the planner needs both --planner-profile and --slo",
                             hint="e.g. --planner-profile p.json --slo ttft=500,itl=50")
        planner.update(planner_values(str(planner_profile), slo, quantile=slo_quantile, interval=planner_interval,
                                      window=planner_window, bounds=planner_bounds, waits=planner_waits))
    elif any(v is not None for v in (slo_quantile, planner_interval, planner_window, planner_bounds, planner_waits)) and not planner:
        raise UsageError("the planner's options need --planner-profile and --slo")
    cfg = build_config(
        prefill or [],
        decode or [],
        file_values=file_values,
        kv=kv or None,
        members=members or None,
        policy=policy.value if policy else None,
        connector=connector.value if connector else None,
        local_fallback=local_fallback,
        host=host,
        port=port,
        connect_timeout=connect_timeout,
        prefill_timeout=prefill_timeout,
        decode_first_byte_timeout=decode_timeout,
        health_interval=health_interval,
        planner=planner or None,
    )
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)

    def on_ready(server) -> None:  # noqa: ANN001 - ProxyServer, imported lazily
        ready, reason = server.app.backends.readiness()
        url = f"{'https' if ssl_ctx is not None else 'http'}://{cfg.host}:{server.port}"
        backends = server.app.backends.report()
        if json_out:
            import msgspec

            line = {"url": url, "ready": ready, "reason": reason, "policy": str(cfg.policy), "backends": backends,
                    "planner": cfg.planner is not None}
            sys.stdout.write(msgspec.json.encode(line).decode() + "\n")
            sys.stdout.flush()
            return
        table = Table(title=f"pdkv proxy on {url} ({cfg.policy})")
        for col in ("role", "url", "up", "detail"):
            table.add_column(col)
        for b in backends:
            detail = b.reason
            if b.role == "prefill":
                engines = ", ".join(f"dp{k}={v}" for k, v in (b.engines or {}).items())
                detail = f"bootstrap {b.bootstrap}" + (f"; {engines}" if engines else f"; {b.reason}")
            table.add_row(b.role, b.url, "yes" if b.up else "no", detail)
        console.print(table)
        if ready:
            console.print(f"ready: {url}/v1/completions")
        else:
            err_console.print(f"[yellow]not ready yet[/]: {reason} (GET /health answers 503 until it is)")

    serve(cfg, on_ready=on_ready, guard=guard, ssl=ssl_ctx)


def register(app: typer.Typer) -> None:
    app.command("proxy", help=HELP)(proxy)
