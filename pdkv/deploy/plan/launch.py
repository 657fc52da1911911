"""What starts a part and where it is reached: `Launch` (the exact command, the environment pdkv sets, the URL and
health path, the cores), and the URL forms of a part's address. Pure.

Every part has one: a vLLM engine's is built from its spec (pdkv.deploy.plan.engine.engine_launch), a bootstrap
server's and the proxy's by pdkv.deploy.plan.topology. What runs it is pdkv.deploy.run.process.ManagedProcess.
"""

from __future__ import annotations

import msgspec

from pdkv.errors import UsageError


class Launch(msgspec.Struct, frozen=True):
    """The exact command and the environment variables pdkv sets on top of the caller's."""

    name: str
    argv: list[str]
    env: dict[str, str]
    url: str
    health_path: str = "/health"
    # CPU engines: the cores every process of the engine (API server, engine core, workers) runs on.
    cpus: list[int] | None = None


def connect_host(host: str) -> str:
    """The address a local client uses to reach a server bound to `host`."""
    if host in ("0.0.0.0", "", "*"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def http_url(host: str, port: int) -> str:
    host = connect_host(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bootstrap_address(url: str) -> str:
    """vLLM's `bootstrap_server_address` form ("host:port") of a bootstrap URL."""
    rest = url.split("://", 1)[-1].rstrip("/")
    if ":" not in rest.rsplit("]", 1)[-1]:
        raise UsageError(f"bootstrap URL {url!r} has no port", hint="write it as http://HOST:PORT")
    return rest
