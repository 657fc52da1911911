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
    return config
