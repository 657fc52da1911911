"""GPU-side checks: GPUDirect RDMA (nvidia_peermem or DMA-BUF), the GPUs NVML sees, and GPU/NIC NUMA placement.

NVML (pynvml) and the CUDA driver (libcuda, through ctypes) are optional: when
absent the checks skip or warn and say why; they never raise.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

from pdkv.doctor.model import CheckResult, DmabufProbe, DoctorOptions, GpuInfo, GpuInventory, GpuLookupError, Host, Status
from pdkv.doctor.rdma import named_devices, parse_numa, read_rdma_devices, skip_for_tcp, target_devices

# cuda.h: CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED (CUDA >= 11.7).
_CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 124
# Linux gained RDMA registration of dma-buf memory (ibv_reg_dmabuf_mr) in 5.12.
_DMABUF_MIN_KERNEL = (5, 12)


def nvml_gpus() -> GpuInventory:
    """The GPUs NVML lists. Raises GpuLookupError (missing=True when there is no pynvml, NVML or driver)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the old `pynvml` wrapper package warns on import
            import pynvml
    except ImportError as exc:
        raise GpuLookupError("pynvml is not installed (pip install nvidia-ml-py)", missing=True) from exc
    absent = tuple(
        getattr(pynvml, n) for n in ("NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded") if hasattr(pynvml, n)
    )
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        raise GpuLookupError(f"NVML did not start: {exc}", missing=isinstance(exc, absent)) from exc
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            gpus.append(
                GpuInfo(
                    index=i,
                    name=_text(pynvml.nvmlDeviceGetName(handle)),
                    memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
                    pci_bus_id=_text(bus),
                )
            )
        driver = _text(pynvml.nvmlSystemGetDriverVersion())
        cuda_int = int(pynvml.nvmlSystemGetCudaDriverVersion())
        return GpuInventory(gpus=gpus, driver=driver, cuda=f"{cuda_int // 1000}.{cuda_int % 1000 // 10}")
    except pynvml.NVMLError as exc:
        raise GpuLookupError(f"NVML query failed: {exc}", missing=False) from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def once(fn: Callable[[], GpuInventory]) -> Callable[[], GpuInventory]:
    """Call `fn` at most once across the checks' threads; later calls get the same answer or error."""
    lock = threading.Lock()
    memo: list = []

    def wrapper() -> GpuInventory:
        with lock:
            if not memo:
                try:
                    memo.append((fn(), None))
                except GpuLookupError as exc:
                    memo.append((None, exc))
        value, error = memo[0]
        if error is not None:
            raise error
        return value

    return wrapper


def cuda_dmabuf_probe() -> DmabufProbe:
    """Ask the CUDA driver, per GPU, whether it exports memory as dma-buf (what Mooncake's DMA-BUF path needs)."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return DmabufProbe(None, "libcuda.so.1 cannot be loaded")
    if (rc := lib.cuInit(0)) != 0:
        return DmabufProbe(None, f"cuInit failed (CUresult {rc})")
    count = ctypes.c_int()
    if (rc := lib.cuDeviceGetCount(ctypes.byref(count))) != 0:
        return DmabufProbe(None, f"cuDeviceGetCount failed (CUresult {rc})")
    values = []
    for i in range(count.value):
        dev, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), i) or lib.cuDeviceGetAttribute(
            ctypes.byref(value), _CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED, dev
        ):
            return DmabufProbe(None, f"CUDA could not report DMA_BUF_SUPPORTED for GPU {i} (driver older than CUDA 11.7?)")
        values.append(bool(value.value))
    return DmabufProbe(values, f"CUDA DMA_BUF_SUPPORTED={[int(v) for v in values]}")


def kernel_version(text: str | None) -> tuple[int, int] | None:
    """(major, minor) of a kernel release such as "6.8.0-45-generic"; None if unparsable."""
    parts = (text or "").split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or "x")
    except (ValueError, IndexError):
        return None


def check_gpudirect_rdma(host: Host, options: DoctorOptions) -> CheckResult:
    """GPU memory can be registered with the NIC: nvidia_peermem is loaded, or DMA-BUF can stand in for it."""
    name = "gpudirect_rdma"
    if skipped := skip_for_tcp(name, options):
        return skipped
    root = host.root
    if root.exists("sys/module/nvidia_peermem") and root.read("sys/module/nvidia_peermem/initstate") in (None, "live"):
        return CheckResult(name, Status.PASS, "nvidia_peermem loaded: the NIC can register GPU memory")
    if not root.exists("sys/module/nvidia"):
        return CheckResult(name, Status.SKIP, "no NVIDIA kernel driver loaded: KV in host memory needs neither nvidia_peermem nor DMA-BUF")
    release = root.read("proc/sys/kernel/osrelease")
    kernel = kernel_version(release)
    driver = root.read("sys/module/nvidia/version") or "unknown"
    banner = root.read("proc/driver/nvidia/version") or ""
    flavour = "kernel module flavour unknown"
    if banner:
        flavour = "open kernel module" if "Open Kernel Module" in banner else "proprietary kernel module"
    probe = host.dmabuf()
    kernel_ok = kernel is not None and kernel >= _DMABUF_MIN_KERNEL
    seen = f"nvidia_peermem not loaded; kernel {release or 'unknown'}, NVIDIA driver {driver} ({flavour}), {probe.detail}"
    fix = "modprobe nvidia_peermem (ships with the NVIDIA driver since R470; add it to /etc/modules-load.d)"
    if kernel_ok and (probe.supported and all(probe.supported) or probe.supported is None and flavour == "open kernel module"):
        certainty = "supported" if probe.supported else "likely (open module, kernel >= 5.12; CUDA not asked)"
        return CheckResult(
            name,
            Status.WARN,
            f"{seen}. DMA-BUF {certainty}: works only with a Mooncake build that registers GPU memory "
            "through DMA-BUF (built without WITH_NVIDIA_PEERMEM); a peermem build fails with 'Bad address'",
            f"{fix}, or confirm your Mooncake build uses DMA-BUF",
        )
    why = "kernel older than 5.12" if not kernel_ok else "the driver does not export dma-buf"
    return CheckResult(name, Status.FAIL, f"{seen}; DMA-BUF not possible ({why}): memory registration fails with 'Bad address'", fix)


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's "00000000:18:00.0" as sysfs names it: "0000:18:00.0"."""
    parts = nvml_bus_id.strip().lower().split(":")
    if len(parts) == 3 and len(parts[0]) > 4:
        parts[0] = parts[0][-4:]
    return ":".join(parts)


def gpu_numa_node(host: Host, gpu: GpuInfo) -> int | None:
    return parse_numa(host.root.read(f"sys/bus/pci/devices/{sysfs_bus_id(gpu.pci_bus_id)}/numa_node"))


def check_gpus(host: Host, options: DoctorOptions) -> CheckResult:
    name = "gpus"
    try:
        inventory = host.gpus()
    except GpuLookupError as exc:
        if exc.missing:
            hint = "pip install nvidia-ml-py" if "not installed" in str(exc) else ""
            return CheckResult(name, Status.SKIP, f"no GPU visible: {exc}", hint)
        return CheckResult(name, Status.WARN, str(exc), "check nvidia-smi; the driver or a GPU may be unhealthy")
    if not inventory.gpus:
        return CheckResult(name, Status.WARN, f"NVML (driver {inventory.driver}) lists no GPU", "check CUDA_VISIBLE_DEVICES and nvidia-smi")
    listed = "; ".join(f"GPU{g.index} {g.name} {g.memory_bytes / 2**30:.0f} GiB {sysfs_bus_id(g.pci_bus_id)}" for g in inventory.gpus)
    return CheckResult(name, Status.PASS, f"{len(inventory.gpus)} GPU(s): {listed}; driver {inventory.driver}, CUDA {inventory.cuda}")


def check_gpu_nic_numa(host: Host, options: DoctorOptions) -> CheckResult:
    """Every GPU has a NIC in use on its own NUMA node (else KV crosses the inter-socket link)."""
    name = "gpu_nic_numa"
    if skipped := skip_for_tcp(name, options):
        return skipped
    try:
        gpus = host.gpus().gpus
    except GpuLookupError as exc:
        return CheckResult(name, Status.SKIP, f"no GPU list: {exc}")
    devices = read_rdma_devices(host.root)
    nics = target_devices(devices, options)
    if not gpus or not nics:
        return CheckResult(name, Status.SKIP, "needs at least one GPU and one RDMA device in use")
    gpu_nodes = {g.index: gpu_numa_node(host, g) for g in gpus}
    if all(n is None for n in gpu_nodes.values()) or all(d.numa_node is None for d in nics):
        return CheckResult(name, Status.SKIP, "sysfs reports no NUMA affinity (single-node host or numa_node = -1)")
    placed = ", ".join(f"GPU{i} node {n}" for i, n in gpu_nodes.items()) + "; " + ", ".join(f"{d.name} node {d.numa_node}" for d in nics)
    far = [(g, gpu_nodes[g.index]) for g in gpus if gpu_nodes[g.index] is not None and all(d.numa_node != gpu_nodes[g.index] for d in nics)]
    if not far:
        return CheckResult(name, Status.PASS, placed)
    gpu, node = far[0]
    near = [d.name for d in devices if d.numa_node == node and d.active_ports]
    which = "--device" if named_devices(options) else "ACTIVE NICs"
    fix = (
        f"for GPU{gpu.index} use a NIC on node {node} (--device {near[0]})"
        if near
        else f"no NIC on node {node}: serve from a GPU on node {nics[0].numa_node} (the NIC's node) instead of GPU{gpu.index}"
    )
    lists = ", ".join(f"GPU{g.index} (node {n})" for g, n in far)
    return CheckResult(name, Status.WARN, f"{lists} has no NIC on its NUMA node among {which}: {placed}", fix)
