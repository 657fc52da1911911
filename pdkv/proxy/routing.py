"""The proxy's pure core: backend specs, routing policies, pairing, request rewriting.

Nothing here does I/O. The HTTP app (`pdkv.proxy.app`) feeds it a snapshot of
which backends are up and how busy they are, and gets back a pairing and the
two request bodies to send.

Rewriting follows the kv_transfer_params contract (docs/proxy.md):
- P's copy computes the prompt and exactly one token: max_tokens 1 and
  min_tokens 1, no stream, no stop strings or stop_token_ids. vLLM's
  MooncakeConnector sends KV only when P finishes by length; a stop token or
  string as P's only token would end it "stopped" and leave D waiting.
- D's copy keeps the client's own max_tokens and stream and names the prefill
  engine (bootstrap address, engine id) and the shared transfer id.
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
from pdkv.protocol import DecodeParams, PrefillParams
from pdkv.proxy.kv_policy import KvConfig

# Fields a prefill must not carry: they could end P before its one token is
# "length capped" (stop, stop_token_ids) or ask for a stream P never gives.
_PREFILL_DROPPED = ("stop", "stop_token_ids", "stream_options")


class Policy(enum.StrEnum):
    ROUND_ROBIN = "round-robin"
    LEAST_OUTSTANDING = "least-outstanding"
    KV_AWARE = "kv-aware"  # by where each prompt's blocks are cached (pdkv.proxy.kv_policy)


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


# --- policies ----------------------------------------------------------------


class Chooser:
    """Picks one of the candidates by policy. Round-robin keeps a cursor; least-outstanding
    takes the fewest in flight, ties broken round-robin so equal backends share load."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self._cursor = 0

    def choose(self, outstanding: Sequence[int]) -> int:
        """The index of the chosen candidate; `outstanding[i]` is candidate i's in-flight count."""
        n = len(outstanding)
        if n == 0:
            raise IndexError("no candidates")
        start = self._cursor % n
        self._cursor = start + 1
        if self.policy is Policy.ROUND_ROBIN:
            return start
        best = start
        for k in range(1, n):
            i = (start + k) % n
            if outstanding[i] < outstanding[best]:
                best = i
        return best


class PrefillTarget(msgspec.Struct, frozen=True):
    """One routable prefill engine: a P server and one of its DP ranks, with that rank's engine id."""

    url: str
    bootstrap_url: str
    dp_rank: int
    dp_size: int
    engine_id: str


class Pairing(msgspec.Struct, frozen=True):
    prefill: PrefillTarget
    decode: str


# --- rewriting ---------------------------------------------------------------


def prefill_request(body: dict[str, Any], transfer_id: str, decode_binding: str = "") -> dict[str, Any]:
    """P's copy of a client's completions body: one token, by length, no stream, no stop conditions.

    `decode_binding` (pdkv's connector only): the commitment to the binding secret only the chosen D gets."""
    p = {k: v for k, v in body.items() if k not in _PREFILL_DROPPED}
    p["max_tokens"] = 1
    if "max_completion_tokens" in p:
        p["max_completion_tokens"] = 1
    p["min_tokens"] = 1
    p["stream"] = False
    # One prefill whatever the client's n: D samples the n choices, each one pulling the same KV.
    n = body.get("n") or 1
    p["n"] = 1
    params = msgspec.to_builtins(PrefillParams(transfer_id=transfer_id, pulls=n, decode_binding=decode_binding))
    if n == 1:
        del params["pulls"]  # P's params stay exactly vLLM's contract where there is nothing to add
    if not decode_binding:
        del params["decode_binding"]
    p["kv_transfer_params"] = params
    return p


def unsupported_field(body: dict[str, Any], connector: KvConnector = KvConnector.PDKV) -> str | None:
    """Why this body cannot be served through P/D (naming the field), or None.

    Beam search runs many sequences that grow and fork from the prompt on one
    engine; it cannot be split into one prefill and a decode elsewhere. vLLM's
    MooncakeConnector sends a transfer to one D request only, so the n
    choices of `n > 1` (n D requests) would leave all but one waiting.
    """
    if body.get("use_beam_search"):
        return "use_beam_search is not supported through prefill/decode disaggregation"
    if connector is KvConnector.MOONCAKE and (body.get("n") or 1) > 1:
        return (
            "n > 1 is not supported with vLLM's MooncakeConnector (it sends each prompt's KV to one decode request); "
            "use pdkv's connector"
        )
    return None


def local_request(body: dict[str, Any]) -> dict[str, Any]:
    """D's copy when D computes the prompt itself: the client's request as a plain vLLM request."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def decode_request(body: dict[str, Any], transfer_id: str, target: PrefillTarget, binding: str = "") -> dict[str, Any]:
    """D's copy: the client's own request, told where its KV comes from; `binding`: the transfer's binding
    secret (pdkv's connector only), which D shows P to prove it is the D this transfer is for."""
    d = dict(body)
    params = msgspec.to_builtins(
        DecodeParams(
            transfer_id=transfer_id,
            remote_bootstrap_addr=target.bootstrap_url,
            remote_engine_id=target.engine_id,
            binding=binding,
        )
    )
    if not binding:
        del params["binding"]
    d["kv_transfer_params"] = params
    return d


def prefill_headers(request_id: str, target: PrefillTarget) -> list[tuple[str, str]]:
    headers = [("X-Request-Id", request_id)]
    if target.dp_size > 1:
        headers.append(("X-data-parallel-rank", str(target.dp_rank)))
    return headers
