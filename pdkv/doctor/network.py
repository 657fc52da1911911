"""VLLM_HOST_IP on hosts with several addresses: the address P and D advertise to each other.

With VLLM_HOST_IP unset the check names the very address `pdkv up` advertises (pdkv.peer_address, the one rule).
"""

from __future__ import annotations

from pdkv.doctor.model import CheckResult, DoctorOptions, Host, Status
from pdkv.errors import ConfigError, StartError
from pdkv.peer_address import advertised_candidates, choose_address, local_addresses, parse_ip


def check_vllm_host_ip(host: Host, options: DoctorOptions) -> CheckResult:
    name = "vllm_host_ip"
    try:
        addrs = host.net_addrs()
    except Exception as exc:  # noqa: BLE001 - psutil missing or refusing is a finding, not a crash
        return CheckResult(name, Status.WARN, f"cannot list this host's addresses: {exc}", "pip install psutil")
    candidates = advertised_candidates(addrs)
    listed = ", ".join(f"{a} ({i})" for i, a in candidates) or "none"
    value = host.env.get("VLLM_HOST_IP", "").strip()
    if value:
        if parse_ip(value) is None:
            return CheckResult(name, Status.FAIL, f"VLLM_HOST_IP={value} is not an IP address", f"set VLLM_HOST_IP to one of: {listed}")
        wanted = parse_ip(value)
        owner = next((i for i, items in addrs.items() for a in items if parse_ip(a) == wanted), None)
        if owner is None:
            return CheckResult(
                name,
                Status.FAIL,
                f"VLLM_HOST_IP={value} is not an address of this host (it has: {listed})",
                f"set VLLM_HOST_IP to this host's address on the network P and D share: {listed}",
            )
        return CheckResult(name, Status.PASS, f"VLLM_HOST_IP={value} is on {owner}")
    try:
        chosen = choose_address(addrs)
    except StartError as exc:
        return CheckResult(name, Status.WARN, f"VLLM_HOST_IP unset and {exc.message}; `pdkv up` would stop there",
                           "pass --host-ip (or host_ip in the deployment file) on a host whose peers are elsewhere")
    where = next(i for i, a in candidates if a == chosen)
    if len(candidates) > 1:
        return CheckResult(
            name,
            Status.WARN,
            f"VLLM_HOST_IP unset on a host with several addresses: {listed}; `pdkv up` advertises {chosen} ({where})",
            "export VLLM_HOST_IP=<this host's address on the network P and D share> (or pass `pdkv up --host-ip`) "
            "if that is not the one",
        )
    return CheckResult(name, Status.PASS, f"VLLM_HOST_IP unset; `pdkv up` advertises {chosen} ({where}), the one candidate")


def check_deployment_key(host: Host, options: DoctorOptions) -> CheckResult:
    """Side channels and bootstraps beyond loopback want the deployment key (docs/security.md)."""
    from pdkv.auth import TOKEN_ENV, token_from_env

    name = "deployment_key"
    try:
        token = token_from_env(host.env)
    except ConfigError as exc:  # a key under a name pdkv does not read: the parts would run without it
        return CheckResult(name, Status.FAIL, exc.message, exc.hint or "")
    if token:
        return CheckResult(name, Status.PASS, f"{TOKEN_ENV} is set: side-channel frames are sealed, bootstrap writes need it")
    value = host.env.get("VLLM_HOST_IP", "").strip()
    if value:
        exposed = not ((ip := parse_ip(value)) is not None and ip.is_loopback)
    else:  # vLLM advertises, and P's in-worker bootstrap listens on, the host's own addresses
        try:
            exposed = any((ip := parse_ip(a)) is not None and not (ip.is_loopback or ip.is_link_local)
                          for a in local_addresses(host.net_addrs()))
        except Exception:  # noqa: BLE001 - no address list: assume the host is on a network
            exposed = True
    if exposed:
        where = f"VLLM_HOST_IP={value}" if value else "this host's network addresses"
        return CheckResult(
            name, Status.WARN,
            f"no deployment key ({TOKEN_ENV}) while side channels and bootstraps listen on {where}: whoever reaches a P "
            "side channel and learns a live transfer id can be sent that prompt's KV",
            f"export {TOKEN_ENV}=$(python3 -c 'import secrets; print(secrets.token_hex(32))') on every part (see docs/security.md)",
        )
    return CheckResult(name, Status.PASS, f"no deployment key, and nothing listens beyond loopback ({TOKEN_ENV} unset)")
