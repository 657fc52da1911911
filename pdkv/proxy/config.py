"""The proxy's configuration: its backends, policy, connector and bounds (`ProxyConfig`), and the parsers that
build it from a TOML file and the command line (`build_config`). Pure.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import msgspec

from pdkv.bootstrap import DEFAULT_PORT
from pdkv.errors import ConfigError
from pdkv.proxy.kv import KvConfig


class Policy(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_OUTSTANDING = "least-outstanding"
    KV_AWARE = "kv-aware"  # by where each prompt's blocks are cached (pdkv.proxy.kv.policy)


class KvConnector(enum.StrEnum):
    """The KV connector the engines behind the proxy run: it decides what a request may ask for."""

    PDKV = "pdkv"
    MOONCAKE = "mooncake"  # vLLM's MooncakeConnector


class PrefillSpec(msgspec.Struct, frozen=True):
    """One prefill server: its OpenAI URL and its Mooncake bootstrap URL."""

    url: str
    bootstrap_url: str


class PlannerConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The planner's live signal in the proxy (pdkv.proxy.planner_loop): a profile, the targets, each role's bounds
    and the waits of the hysteresis (pdkv.planner.signal.ScalePolicy's)."""

    profile: str  # a file from `pdkv profile`
    ttft_ms: float
    itl_ms: float
    quantile: float = 0.9
    interval_s: float = 5.0  # how often the desired counts are recomputed
    window_s: float = 30.0  # what the observation covers
    min_prefill: int = 1
    max_prefill: int = 256
    min_decode: int = 1
    max_decode: int = 256
    up_after_s: float = 0.0
    down_after_s: float = 60.0
    down_margin: float = 0.8


class ProxyConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything `pdkv proxy` needs; timeouts in seconds."""

    prefill: tuple[PrefillSpec, ...]
    decode: tuple[str, ...]
    host: str = "127.0.0.1"
    port: int = 8000
    policy: Policy = Policy.ROUND_ROBIN
    connector: KvConnector = KvConnector.PDKV
    # No prefill engine up, or P failing before D's KV could come: D computes the prompt itself.
    local_fallback: bool = True
    connect_timeout: float = 5.0
    prefill_timeout: float = 120.0
    decode_first_byte_timeout: float = 180.0
    health_interval: float = 5.0
    health_timeout: float = 2.0
    unhealthy_after: int = 2
    # Bootstrap servers whose members registries the proxy follows (pdkv.bootstrap.members).
    members: tuple[str, ...] = ()
    members_interval: float = 2.0
    # A TCP connect to every backend that is up this often; probe_failures in a row take it out. 0: off.
    probe_interval: float = 1.0
    probe_failures: int = 2
    trace_capacity: int = 4096
    kv: KvConfig = KvConfig()  # the kv-aware policy's settings
    planner: PlannerConfig | None = None  # the desired-count signal (off when None)


def _origin(url: str, what: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{what} {url!r} is not an http URL", hint="write it as http://HOST:PORT")
    if parts.scheme == "https":
        raise ConfigError(f"{what} {url!r}: https backends are not supported", hint="reach backends over plain http")
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"http://{host}:{parts.port or 80}"


def default_bootstrap_port() -> int:
    raw = os.environ.get("VLLM_MOONCAKE_BOOTSTRAP_PORT")
    try:
        return int(raw) if raw else DEFAULT_PORT
    except ValueError:
        raise ConfigError(f"VLLM_MOONCAKE_BOOTSTRAP_PORT={raw!r} is not a port number") from None


def parse_prefill(spec: str) -> PrefillSpec:
    """`URL[,BOOTSTRAP_URL]`; the bootstrap defaults to P's host on VLLM_MOONCAKE_BOOTSTRAP_PORT (8998).

    BOOTSTRAP_URL may be a bare port number, meaning P's host on that port.
    """
    url, _, bootstrap = spec.partition(",")
    url = _origin(url.strip(), "prefill URL")
    host = urlsplit(url).netloc.rsplit(":", 1)[0]
    bootstrap = bootstrap.strip()
    if not bootstrap:
        bootstrap = f"http://{host}:{default_bootstrap_port()}"
    elif bootstrap.isdigit():
        bootstrap = f"http://{host}:{bootstrap}"
    return PrefillSpec(url=url, bootstrap_url=_origin(bootstrap, "bootstrap URL"))


def parse_decode(spec: str) -> str:
    return _origin(spec.strip(), "decode URL")


def build_config(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    file_values: dict[str, Any] | None = None,
    **overrides: Any,
) -> ProxyConfig:
    """Merge a TOML file's values with command-line ones (the command line wins) and validate.

    The file has `prefill = ["URL[,BOOTSTRAP]", ...]`, `decode = [...]` and any
    other ProxyConfig field by name (dashes or underscores).
    """
    values: dict[str, Any] = {}
    for key, value in (file_values or {}).items():
        values[key.replace("-", "_")] = value
    values.update({k: v for k, v in overrides.items() if v is not None})
    p_specs = list(prefill) or list(values.pop("prefill", []) or [])
    d_specs = list(decode) or list(values.pop("decode", []) or [])
    values.pop("prefill", None)
    values.pop("decode", None)
    members = values.get("members") or ()
    if isinstance(members, str):
        members = [members]
    values["members"] = tuple(_origin(m, "members registry URL") for m in members)
    follow = " or --members http://BOOTSTRAP:PORT"
    if not p_specs and not members:
        raise ConfigError("no prefill server given", hint=f"pass --prefill http://HOST:PORT (repeatable){follow} or a --config file")
    if not d_specs and not members:
        raise ConfigError("no decode server given", hint=f"pass --decode http://HOST:PORT (repeatable){follow} or a --config file")
    values["prefill"] = tuple(parse_prefill(s) for s in p_specs)
    values["decode"] = tuple(parse_decode(s) for s in d_specs)
    try:
        config = msgspec.convert(values, ProxyConfig)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"invalid proxy configuration: {exc}") from None
    if config.probe_interval < 0 or config.probe_failures < 1:
        raise ConfigError("probe-interval must be 0 or more and probe-failures at least 1")
    for name in ("connect_timeout", "prefill_timeout", "decode_first_byte_timeout", "health_interval", "health_timeout",
                 "members_interval"):
        if getattr(config, name) <= 0:
            raise ConfigError(f"{name.replace('_', '-')} must be positive")
    if config.planner is not None:
        check_planner(config.planner)
    return config


def check_planner(p: PlannerConfig) -> None:
    """ConfigError for targets, bounds or waits the signal cannot run with (the profile is read at start-up)."""
    if not (p.ttft_ms > 0 and p.itl_ms > 0 and 0 < p.quantile < 1):
        raise ConfigError("the planner needs ttft and itl targets above 0 ms and 0 < quantile < 1", hint="e.g. --slo ttft=500,itl=50")
    if not (p.interval_s > 0 and p.window_s >= p.interval_s):
        raise ConfigError(f"the planner needs interval > 0 and window >= interval, got {p.interval_s:g} s and {p.window_s:g} s")
    for role, lo, hi in (("prefill", p.min_prefill, p.max_prefill), ("decode", p.min_decode, p.max_decode)):
        if not 1 <= lo <= hi:
            raise ConfigError(f"the planner's {role} bounds need 1 <= min <= max, got {lo}..{hi}", hint="e.g. --planner-bounds prefill=1:4")
    if p.up_after_s < 0 or p.down_after_s < 0 or not 0 < p.down_margin <= 1:
        raise ConfigError("the planner needs up_after_s >= 0, down_after_s >= 0 and 0 < down_margin <= 1")


def planner_values(profile: str, slo: str, *, quantile: float | None = None, interval: float | None = None,
                   window: float | None = None, bounds: str | None = None, waits: str | None = None) -> dict[str, Any]:
    """`pdkv proxy`'s planner flags as a [planner] table: `slo` is `ttft=MS,itl=MS`, `bounds` `prefill=MIN:MAX,decode=MIN:MAX`,
    `waits` `up=S,down=S,margin=F`. ConfigError (one line) for a value that does not parse."""
    values: dict[str, Any] = {"profile": profile}
    for part in _pairs(slo, "--slo", "ttft=MS,itl=MS"):
        key, value = part
        if key not in ("ttft", "itl"):
            raise ConfigError(f"--slo takes ttft and itl, got {key!r}", hint="e.g. --slo ttft=500,itl=50")
        values[f"{key}_ms"] = _number(value, "--slo")
    if "ttft_ms" not in values or "itl_ms" not in values:
        raise ConfigError(f"--slo needs both ttft and itl, got {slo!r}", hint="e.g. --slo ttft=500,itl=50")
    for key, value in _pairs(bounds or "", "--planner-bounds", "prefill=MIN:MAX,decode=MIN:MAX"):
        lo, sep, hi = value.partition(":")
        if key not in ("prefill", "decode") or not sep or not lo.strip().isdigit() or not hi.strip().isdigit():
            raise ConfigError(f"--planner-bounds takes prefill=MIN:MAX,decode=MIN:MAX, got {bounds!r}")
        values[f"min_{key}"], values[f"max_{key}"] = int(lo), int(hi)
    names = {"up": "up_after_s", "down": "down_after_s", "margin": "down_margin"}
    for key, value in _pairs(waits or "", "--planner-waits", "up=S,down=S,margin=F"):
        if key not in names:
            raise ConfigError(f"--planner-waits takes up, down and margin, got {key!r}",
                              hint="e.g. --planner-waits up=0,down=60,margin=0.8")
        values[names[key]] = _number(value, "--planner-waits")
    for key, value in (("quantile", quantile), ("interval_s", interval), ("window_s", window)):
        if value is not None:
            values[key] = value
    return values


def _pairs(text: str, flag: str, form: str) -> list[tuple[str, str]]:
    out = []
    for part in (p for p in text.split(",") if p.strip()):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"{flag} takes {form}, got {text!r}")
        out.append((key.strip().lower().removesuffix("_ms"), value.strip()))
    return out


def _number(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(f"{flag}: {text!r} is not a number") from None
