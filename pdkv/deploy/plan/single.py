"""`pdkv up`'s shapes other than a deployment file: one engine by role (`--role`), and the local 1P1D's core split."""

from __future__ import annotations

from typing import Any

import msgspec

from pdkv.deploy.plan.engine import EngineSpec, engine_launch, joining
from pdkv.deploy.plan.launch import http_url
from pdkv.deploy.plan.ports import ANY_ADDRESS, PortUse
from pdkv.deploy.plan.schema import Deployment
from pdkv.deploy.plan.topology import Part
from pdkv.errors import UsageError


def role_parts(role: str, members: str | None = None, **kw: Any) -> tuple[list[Part], list[str]]:
    """One P or D engine started by flags (`pdkv up --role`), joining `members` when given; and the bootstraps it names."""
    if role not in ("prefill", "decode"):
        raise UsageError(f"unknown role {role!r}", hint="use --role prefill or --role decode")
    if kw["bootstrap_url"] and role == "decode":
        raise UsageError("--bootstrap is for prefill engines", hint="decode engines learn the bootstrap from the proxy's request")
    spec = EngineSpec(role=role, **kw)  # type: ignore[arg-type]
    launch = engine_launch(spec, name=role)
    if members:
        if spec.connector != "pdkv":
            raise UsageError("--members needs pdkv's connector",
                             hint="vLLM's MooncakeConnector joins no members registry; list it in the proxy")
        from pdkv.proxy import parse_decode  # the proxy's parser of a URL; imported only for --members

        reached = launch.url if spec.host not in ("0.0.0.0", "::", "") else http_url(launch.env["VLLM_HOST_IP"], spec.port)
        launch = joining(launch, parse_decode(members), reached)
    ports = [PortUse(role, "HTTP", spec.host, spec.port, "--port")]
    if role == "prefill" and not spec.bootstrap_url and spec.bootstrap_port is not None:
        ports.append(PortUse(role, "bootstrap", ANY_ADDRESS, spec.bootstrap_port, "--bootstrap-port"))
    return [Part(kind=role, launch=launch, ports=ports, spec=spec)], [spec.bootstrap_url] if spec.bootstrap_url else []


def with_cores(dep: Deployment, p_cores: str, d_cores: str) -> Deployment:
    prefill = [msgspec.structs.replace(e, omp_bind=p_cores) for e in dep.prefill]
    decode = [msgspec.structs.replace(e, omp_bind=d_cores) for e in dep.decode]
    return msgspec.structs.replace(dep, prefill=prefill, decode=decode)


def with_extra(dep: Deployment, extra: list[str]) -> Deployment:
    return msgspec.structs.replace(dep, extra_args=[*dep.extra_args, *extra])
