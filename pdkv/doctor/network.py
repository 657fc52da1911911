"""VLLM_HOST_IP on hosts with several addresses: the address P and D advertise to each other."""

from __future__ import annotations

import ipaddress
import socket

from pdkv.doctor.model import CheckResult, DoctorOptions, Host, Status


def local_addresses() -> dict[str, list[str]]:
    """Interface name -> its IPv4 and IPv6 addresses (without %scope), as psutil lists them."""
    import psutil

    return {
        name: [a.address.split("%", 1)[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        for name, addrs in psutil.net_if_addrs().items()
    }


def advertised_candidates(addrs: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(interface, address) pairs vLLM could pick for itself: non-loopback IPv4, else global IPv6."""
    parsed = [(iface, ipaddress.ip_address(a)) for iface, items in addrs.items() for a in items if _parses(a)]
    v4 = [(i, str(ip)) for i, ip in parsed if ip.version == 4 and not ip.is_loopback]
    if v4:
        return v4
    return [(i, str(ip)) for i, ip in parsed if ip.version == 6 and not ip.is_loopback and not ip.is_link_local]


def _parses(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


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
        if not _parses(value):
            return CheckResult(name, Status.FAIL, f"VLLM_HOST_IP={value} is not an IP address", f"set VLLM_HOST_IP to one of: {listed}")
        wanted = ipaddress.ip_address(value)
        owner = next((i for i, items in addrs.items() for a in items if _parses(a) and ipaddress.ip_address(a) == wanted), None)
        if owner is None:
            return CheckResult(
                name,
                Status.FAIL,
                f"VLLM_HOST_IP={value} is not an address of this host (it has: {listed})",
                f"set VLLM_HOST_IP to this host's address on the network P and D share: {listed}",
            )
        return CheckResult(name, Status.PASS, f"VLLM_HOST_IP={value} is on {owner}")
    if len(candidates) > 1:
        return CheckResult(
            name,
            Status.WARN,
            f"VLLM_HOST_IP unset on a host with several addresses: {listed}; vLLM advertises the default route's",
            "export VLLM_HOST_IP=<this host's address on the network P and D share> before starting vLLM",
        )
    return CheckResult(name, Status.PASS, f"VLLM_HOST_IP unset; one candidate address: {listed}")


def check_deployment_key(host: Host, options: DoctorOptions) -> CheckResult:
    """Side channels and bootstraps beyond loopback want the deployment key (docs/security.md)."""
    from pdkv.auth import LEGACY_TOKEN_ENV, TOKEN_ENV

    name = "deployment_key"
    if host.env.get(TOKEN_ENV) or host.env.get(LEGACY_TOKEN_ENV):
        return CheckResult(name, Status.PASS, f"{TOKEN_ENV} is set: side-channel frames are sealed, bootstrap writes need it")
    value = host.env.get("VLLM_HOST_IP", "").strip()
    if value:
        exposed = not (_parses(value) and ipaddress.ip_address(value).is_loopback)
    else:  # vLLM advertises, and P's in-worker bootstrap listens on, the host's own addresses
        try:
            exposed = bool(advertised_candidates(host.net_addrs()))
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
