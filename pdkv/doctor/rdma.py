"""RDMA NICs as sysfs shows them, and the checks on them: devices, the named device, uverbs, RoCE GIDs.

Layout read (all below the doctor's root):
  sys/class/infiniband/<dev>/ports/<n>/{state,phys_state,link_layer,rate}
  sys/class/infiniband/<dev>/ports/<n>/gids/<i>, gid_attrs/{types,ndevs}/<i>
  sys/class/infiniband/<dev>/device/numa_node
  sys/class/infiniband_verbs/uverbs<k>/ibdev, dev/infiniband/uverbs<k>
"""

from __future__ import annotations

import ipaddress
import os
import re

import msgspec

from pdkv.doctor.model import CheckResult, DoctorOptions, Host, Status
from pdkv.doctor.sysroot import SysRoot

IB_CLASS = "sys/class/infiniband"
_RATE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*Gb/sec")
_STATE = re.compile(r"^\s*(\d+)\s*:\s*(\S+)")
_WIDTH = re.compile(r"\(([^)]*)\)")


class RdmaPort(msgspec.Struct, frozen=True):
    device: str
    port: int
    state: str  # ACTIVE, DOWN, INIT, ARMED, ...
    phys_state: str  # LinkUp, Polling, Disabled, ...
    link_layer: str  # InfiniBand or Ethernet
    rate_gbps: float | None
    rate_text: str

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def label(self) -> str:
        return f"{self.device}/{self.port}"

    def describe(self) -> str:
        rate = f"{self.rate_gbps:g} Gb/s" if self.rate_gbps is not None else "rate unknown"
        if width := _WIDTH.search(self.rate_text):
            rate += f" {width[1]}"
        return f"{self.label} {self.state} {self.phys_state} {self.link_layer} {rate}"


class RdmaDevice(msgspec.Struct, frozen=True):
    name: str
    ports: list[RdmaPort]
    numa_node: int | None  # None when sysfs says -1 (no NUMA affinity) or nothing

    @property
    def active_ports(self) -> list[RdmaPort]:
        return [p for p in self.ports if p.active]

    @property
    def best_rate(self) -> float:
        return max((p.rate_gbps or 0.0 for p in self.active_ports), default=0.0)


def parse_rate(text: str | None) -> float | None:
    """Gb/s from a sysfs rate such as "400 Gb/sec (4X NDR)" or "2.5 Gb/sec (1X SDR)"; None if unparsable."""
    match = _RATE.search(text or "")
    return float(match[1]) if match else None


def parse_state(text: str | None) -> str:
    """The word of a sysfs state such as "4: ACTIVE" or "5: LinkUp"; "unknown" if absent."""
    match = _STATE.match(text or "")
    return match[2] if match else (text or "unknown").strip() or "unknown"


def parse_numa(text: str | None) -> int | None:
    try:
        node = int(text or "")
    except ValueError:
        return None
    return node if node >= 0 else None


def read_rdma_devices(root: SysRoot) -> list[RdmaDevice]:
    devices = []
    for name in root.listdir(IB_CLASS):
        base = f"{IB_CLASS}/{name}"
        ports = []
        for port in root.listdir(f"{base}/ports"):
            if not port.isdigit():
                continue
            p = f"{base}/ports/{port}"
            rate_text = root.read(f"{p}/rate") or ""
            ports.append(
                RdmaPort(
                    device=name,
                    port=int(port),
                    state=parse_state(root.read(f"{p}/state")),
                    phys_state=parse_state(root.read(f"{p}/phys_state")),
                    link_layer=root.read(f"{p}/link_layer") or "unknown",
                    rate_gbps=parse_rate(rate_text),
                    rate_text=rate_text,
                )
            )
        devices.append(RdmaDevice(name=name, ports=ports, numa_node=parse_numa(root.read(f"{base}/device/numa_node"))))
    return devices


def named_devices(options: DoctorOptions) -> list[str]:
    """--device as Mooncake takes it: one name or a comma-separated list."""
    return [d.strip() for d in (options.device or "").split(",") if d.strip()]


def target_devices(devices: list[RdmaDevice], options: DoctorOptions) -> list[RdmaDevice]:
    """The devices a deployment would use: those named by --device, else every one with an ACTIVE port."""
    names = named_devices(options)
    if names:
        return [d for d in devices if d.name in names]
    return [d for d in devices if d.active_ports]


def skip_for_tcp(name: str, options: DoctorOptions) -> CheckResult | None:
    if options.transport == "tcp":
        return CheckResult(name, Status.SKIP, "transport tcp moves KV over sockets: no RDMA NIC involved")
    if options.transport == "cma":
        return CheckResult(name, Status.SKIP, "transport cma moves KV between processes of this host: no RDMA NIC involved")
    if options.transport == "socket":
        return CheckResult(name, Status.SKIP, "transport socket moves KV over pdkv's TCP connections: no RDMA NIC involved")
    return None


def check_rdma_devices(host: Host, options: DoctorOptions) -> CheckResult:
    name = "rdma_devices"
    if skipped := skip_for_tcp(name, options):
        return skipped
    devices = read_rdma_devices(host.root)
    if not devices:
        return CheckResult(
            name,
            Status.FAIL,
            f"no RDMA devices under /{IB_CLASS}",
            "load the NIC's RDMA driver (e.g. modprobe mlx5_ib), expose the NIC to this container, or use --transport tcp",
        )
    ports = [p for d in devices for p in d.ports]
    seen = "; ".join(p.describe() + (f" NUMA {d.numa_node}" if d.numa_node is not None else "") for d in devices for p in d.ports)
    if not any(p.active for p in ports):
        return CheckResult(name, Status.FAIL, f"no ACTIVE port: {seen}", _port_hint(ports[0]) if ports else "")
    return CheckResult(name, Status.PASS, seen)


def _port_hint(port: RdmaPort) -> str:
    """The likeliest fix for a port that is not ACTIVE, from what its state says."""
    if port.phys_state == "Disabled":
        enable = f"ip link set <netdev> up, or ibportstate {port.device} {port.port} enable"
        return f"the port is administratively disabled: enable it ({enable})"
    if port.phys_state == "Polling":
        return f"{port.label} sees no link partner: check the cable and the switch port"
    if port.phys_state == "LinkUp" and port.state in ("INIT", "ARMED"):
        return "the link is up but no subnet manager configured it: start opensm or check the fabric's SM"
    if port.link_layer == "Ethernet":
        return f"bring the RoCE netdev up (ip link set <netdev> up) and check the cable of {port.label}"
    return f"bring {port.label} up: check cable, switch and subnet manager (ibstat {port.device})"


def check_rdma_device(host: Host, options: DoctorOptions) -> CheckResult:
    """The --device named NIC(s) exist and are ACTIVE, and none is slower than the fastest ACTIVE NIC here."""
    name = "rdma_device"
    if skipped := skip_for_tcp(name, options):
        return skipped
    devices = read_rdma_devices(host.root)
    active = [d for d in devices if d.active_ports]
    names = named_devices(options)
    if not devices:
        if names:
            return CheckResult(name, Status.FAIL, f"{', '.join(names)} not found: no RDMA devices at all", "see rdma_devices")
        return CheckResult(name, Status.SKIP, "no RDMA devices (see rdma_devices)")
    fastest = max(active, key=lambda d: d.best_rate, default=None)
    present = ", ".join(f"{d.name} ({d.best_rate:g} Gb/s ACTIVE)" if d.active_ports else f"{d.name} (not ACTIVE)" for d in devices)
    if not names:
        rates = sorted({d.best_rate for d in active})
        if fastest is None:
            return CheckResult(name, Status.SKIP, "no --device given and no ACTIVE device (see rdma_devices)")
        if len(rates) > 1:
            return CheckResult(
                name,
                Status.WARN,
                f"no --device given; ACTIVE devices differ in rate ({', '.join(f'{r:g}' for r in rates)} Gb/s): {present}",
                f"pin the fast NIC: --device {fastest.name} here and device_name={fastest.name} in kv_connector_extra_config",
            )
        return CheckResult(name, Status.PASS, f"no --device given; ACTIVE: {present}")

    by_name = {d.name: d for d in devices}
    missing = [n for n in names if n not in by_name]
    if missing:
        best = f"--device {fastest.name}" if fastest else "an RDMA device that exists here"
        return CheckResult(
            name,
            Status.FAIL,
            f"{', '.join(missing)} not found; present: {present}",
            f"use {best} (names from ibv_devices or ls /{IB_CLASS})",
        )
    problems, notes = [], []
    for dev_name in names:
        dev = by_name[dev_name]
        if not dev.active_ports:
            states = "; ".join(p.describe() for p in dev.ports) or "no ports"
            problems.append((f"{dev_name} has no ACTIVE port: {states}", _port_hint(dev.ports[0]) if dev.ports else "check the NIC driver"))
            continue
        notes.append(max(dev.active_ports, key=lambda p: p.rate_gbps or 0.0).describe())
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(p for p, _ in problems), problems[0][1])
    slow = [n for n in names if fastest and by_name[n].best_rate < fastest.best_rate]
    if slow:
        return CheckResult(
            name,
            Status.WARN,
            f"{', '.join(slow)} at {by_name[slow[0]].best_rate:g} Gb/s is slower than {fastest.name} at {fastest.best_rate:g} Gb/s",
            f"use --device {fastest.name} (and device_name={fastest.name} in kv_connector_extra_config)",
        )
    return CheckResult(name, Status.PASS, "; ".join(notes))


def check_uverbs(host: Host, options: DoctorOptions) -> CheckResult:
    """User-space verbs need /dev/infiniband/uverbs<k>, one per device, readable and writable."""
    name = "uverbs"
    if skipped := skip_for_tcp(name, options):
        return skipped
    nodes = [n for n in host.root.listdir("dev/infiniband") if n.startswith("uverbs")]
    fix = "pass the device nodes in (docker --device=/dev/infiniband, k8s rdma device plugin) and load ib_uverbs"
    if not nodes:
        return CheckResult(name, Status.FAIL, "no /dev/infiniband/uverbs* device nodes", fix)
    unusable = [n for n in nodes if not os.access(host.root.path(f"dev/infiniband/{n}"), os.R_OK | os.W_OK)]
    if unusable:
        return CheckResult(
            name,
            Status.FAIL,
            f"no read/write access to {', '.join(unusable)}",
            "run as a user in the rdma group, or give the container access to /dev/infiniband",
        )
    # Which verbs node belongs to which device, where sysfs says.
    owner = {n: host.root.read(f"sys/class/infiniband_verbs/{n}/ibdev") for n in nodes}
    devices = read_rdma_devices(host.root)
    wanted = [d.name for d in target_devices(devices, options)]
    mapped = {dev for dev in owner.values() if dev}
    lacking = [d for d in wanted if mapped and d not in mapped]
    seen = ", ".join(f"{n}->{owner[n]}" if owner[n] else n for n in nodes)
    if lacking:
        return CheckResult(name, Status.FAIL, f"no uverbs node for {', '.join(lacking)}; present: {seen}", fix)
    return CheckResult(name, Status.PASS, seen)


class Gid(msgspec.Struct, frozen=True):
    index: int
    address: str
    type: str  # "RoCE v2", "IB/RoCE v1", ...
    netdev: str

    @property
    def ip(self) -> ipaddress.IPv6Address | None:
        try:
            return ipaddress.IPv6Address(self.address)
        except ValueError:
            return None

    @property
    def problem(self) -> str | None:
        """Why Mooncake cannot use this GID for RoCE, or None if it can."""
        ip = self.ip
        if ip is None or int(ip) == 0:
            return "null"
        if self.type.strip().lower() != "roce v2":
            return f"type {self.type or 'unknown'}"
        if ip.is_link_local:
            return "link-local"
        return None

    def describe(self) -> str:
        ip = self.ip
        shown = str(ip.ipv4_mapped or ip) if ip is not None else self.address
        extra = f", {self.netdev}" if self.netdev else ""
        return f"index {self.index}: {shown} ({self.type or 'type unknown'}{extra})"


def read_gids(root: SysRoot, port: RdmaPort) -> list[Gid]:
    p = f"{IB_CLASS}/{port.device}/ports/{port.port}"
    gids = []
    for idx in root.listdir(f"{p}/gids"):
        if not idx.isdigit():
            continue
        gids.append(
            Gid(
                index=int(idx),
                address=root.read(f"{p}/gids/{idx}") or "",
                type=root.read(f"{p}/gid_attrs/types/{idx}") or "",
                netdev=root.read(f"{p}/gid_attrs/ndevs/{idx}") or "",
            )
        )
    return gids


def check_roce_gid(host: Host, options: DoctorOptions) -> CheckResult:
    """Each RoCE port in use has a RoCEv2 GID that is neither null nor link-local (or MC_GID_INDEX names one)."""
    name = "roce_gid"
    if skipped := skip_for_tcp(name, options):
        return skipped
    in_use = target_devices(read_rdma_devices(host.root), options)
    if not in_use:
        return CheckResult(name, Status.SKIP, "no RDMA device in use (see rdma_devices)")
    ports = [p for d in in_use for p in d.ports if p.link_layer == "Ethernet"]
    if not ports:
        return CheckResult(name, Status.SKIP, "no RoCE (Ethernet link layer) port in use: InfiniBand needs no routable GID")
    forced = host.env.get("MC_GID_INDEX")
    seen, failures = [], []
    for port in ports:
        gids = read_gids(host.root, port)
        nonnull = [g for g in gids if g.problem != "null"]
        if forced is not None and forced.strip().isdigit():
            chosen = next((g for g in gids if g.index == int(forced)), None)
            if chosen is None or chosen.problem:
                why = chosen.problem if chosen else "absent"
                good = next((g for g in gids if not g.problem), None)
                fix = f"set MC_GID_INDEX={good.index} (or unset it)" if good else "unset MC_GID_INDEX; give the netdev an IP address"
                failures.append((f"{port.label}: MC_GID_INDEX={forced} is {why}", fix))
            else:
                seen.append(f"{port.label} MC_GID_INDEX {chosen.describe()}")
            continue
        good = [g for g in gids if not g.problem]
        if good:
            # Mooncake prefers an IPv4-mapped RoCEv2 GID; show the one it would take.
            best = next((g for g in good if g.ip is not None and g.ip.ipv4_mapped), good[0])
            seen.append(f"{port.label} {best.describe()}")
            continue
        have = "; ".join(f"{g.describe()} [{g.problem}]" for g in nonnull) or "every GID is null"
        netdev = next((g.netdev for g in gids if g.netdev), "") or "the port's netdev"
        failures.append(
            (
                f"{port.label} has no usable RoCEv2 GID: {have}",
                f"give {netdev} a routable IPv4/IPv6 address (ip addr add ... dev {netdev}); a RoCEv2 GID appears for it",
            )
        )
    if failures:
        return CheckResult(name, Status.FAIL, "; ".join(f for f, _ in failures), failures[0][1])
    return CheckResult(name, Status.PASS, "; ".join(seen))
