"""`PdkvConnector`: the KVConnectorBase_V1 shell vLLM loads; the logic lives in scheduler.py and worker.py.

This module is the connector's one seam with vLLM, and it serves vLLM 0.26 to 0.34:
- transfer results: 0.32+ ask `get_transfer_results` (receive failures beside the completions); 0.26 asks
  `get_finished`, and a failed pull reaches it as load-error blocks alone. Both go through `_collect`.
- KV layout: LBHNC (per layer, per block: heads x tokens x content) where the running vLLM names it;
  0.26 knows only NHD and HND, and its HND gives the same dense pages (`layout.kv_layout_for`).
- `CacheHitSource` (0.32+) labels the tokens D loads as peer-to-peer; 0.26 has no such metric.
- connector stats (0.26+): each step's counts go to vLLM, which exports them on the engine's /metrics
  (pdkv.connector.prom).
0.33's base class only adds `supports_sleep_mode`, `unregister_kv_caches` and `restore_kv_caches`, all with
defaults this connector keeps.
- 0.34: `kv_cache_access` declares how the workers reach the KV memory (config.kv_cache_access: REGISTERS for
  Mooncake, EXPORTS_FD for ipc, which keeps the extensible KV cache); `may_load_async` is true only for a D's
  remote prefill (what `get_num_new_matched_tokens` answers asynchronously); lookahead block hashes are not
  used (docs/connector.md says why).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

try:  # vLLM 0.32+
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # vLLM 0.26
    KVConnectorTransferResults = None
    CacheHitSource = None
try:  # vLLM 0.34+
    from vllm.config.kv_transfer import KVCacheAccess
except ImportError:  # vLLM 0.26-0.33: every KV cache is one cudaMalloc'd allocation per tensor
    KVCacheAccess = None

from pdkv.connector.config import kv_cache_access, load_config
from pdkv.connector.layout import kv_layout_for, refusal
from pdkv.connector.prom import PdkvConnectorStats, PdkvPromMetrics
from pdkv.connector.scheduler import ConnectorScheduler, StepMeta
from pdkv.connector.worker import ConnectorWorker, EngineIdentity
from pdkv.errors import UnsupportedModelError

if TYPE_CHECKING:
    import torch

log = logging.getLogger("pdkv.connector")


def _log_through_vllm() -> None:
    """Send pdkv's connector log to vLLM's handlers, so it appears in the engine's log."""
    ours, theirs = logging.getLogger("pdkv"), logging.getLogger("vllm")
    if not ours.handlers and theirs.handlers:
        for h in theirs.handlers:
            ours.addHandler(h)
        ours.setLevel(logging.INFO)
        ours.propagate = False


_log_through_vllm()


class PdkvConnectorMetadata(KVConnectorMetadata):
    def __init__(self, step: StepMeta) -> None:
        self.step = step


def _layer_index(name: str) -> tuple[int, str]:
    digits = [int(p) for p in name.split(".") if p.isdigit()]
    return (digits[0] if digits else -1, name)


def _running_vllm_layouts() -> frozenset[str]:
    try:  # vLLM 0.32+: the layout enum
        from vllm.v1.kv_cache_layout import KVCacheLayout
    except ImportError:  # vLLM 0.26: a Literal of two names
        from typing import get_args

        from vllm.v1.attention.backends.utils import KVCacheLayoutType

        return frozenset(get_args(KVCacheLayoutType))
    return frozenset(m.name for m in KVCacheLayout)


def _published_events(vllm_config: Any) -> dict[str, str | None]:
    ev = getattr(vllm_config, "kv_events_config", None)
    if ev is None or not ev.enable_kv_cache_events or ev.publisher != "zmq":
        return {}
    return {"kv_events": ev.endpoint, "kv_events_replay": ev.replay_endpoint or None}


class PdkvConnector(KVConnectorBase_V1):
    """P pushes each finished prompt's KV into the blocks D allocated, over Mooncake; see docs/connector.md."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        kt = vllm_config.kv_transfer_config
        self.config = load_config(kt.kv_connector_extra_config)
        if kt.kv_role not in ("kv_producer", "kv_consumer"):
            raise UnsupportedModelError(f"pdkv's connector needs kv_role kv_producer or kv_consumer, got {kt.kv_role!r}")
        self.is_producer = kt.kv_role == "kv_producer"
        self.engine_id: str = kt.engine_id
        if KVCacheAccess is not None and self.config.transport == "ipc" and role == KVConnectorRole.SCHEDULER:
            log.info("pdkv: ipc shares D's KV memory by %s", "file descriptor (vLLM's extensible KV cache on)"
                     if self.config.ipc_handles == "fd" else "legacy CUDA IPC handles (ipc_handles=legacy: vLLM's extensible KV cache off)")
        self._refuse_unsupported(vllm_config, kv_cache_config)
        self._scheduler: ConnectorScheduler | None = None
        self._worker: ConnectorWorker | None = None
        self._load_errors: set[int] = set()  # D: blocks of failed pulls, until vLLM asks for them
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = ConnectorScheduler(
                is_producer=self.is_producer, is_consumer=not self.is_producer, block_size=vllm_config.cache_config.block_size
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            pc = vllm_config.parallel_config
            if pc.pipeline_parallel_size != 1:
                raise UnsupportedModelError("pdkv's connector does not support pipeline parallelism")
            self._worker = ConnectorWorker(
                self.config,
                engine_id=self.engine_id,
                is_producer=self.is_producer,
                tp_rank=get_tensor_model_parallel_rank(),
                tp_size=pc.tensor_parallel_size,
                kv_heads=vllm_config.model_config.get_total_num_kv_heads(),
                dp_rank=getattr(pc, "data_parallel_index", pc.data_parallel_rank),
                num_blocks=kv_cache_config.num_blocks,
                identity=EngineIdentity(
                    model=str(vllm_config.model_config.served_model_name),
                    block_size=vllm_config.cache_config.block_size, dp_size=pc.data_parallel_size,
                    **_published_events(vllm_config),
                ),
            )

    @staticmethod
    def _refuse_unsupported(vllm_config: Any, kv_cache_config: Any) -> None:
        groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
        spec_names = [type(g.kv_cache_spec).__name__ for g in groups]
        why = refusal(
            use_mla=bool(vllm_config.model_config.use_mla),
            kv_groups=len(groups) if groups else 1,
            sliding_window=any(n != "FullAttentionSpec" for n in spec_names),
            spec_names=spec_names,
        )
        if why is not None:
            raise UnsupportedModelError(why, hint="serve this model colocated, or with vLLM's own connector")

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        return kv_layout_for(_running_vllm_layouts())

    if KVCacheAccess is not None:

        @classmethod
        def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
            flags = KVCacheAccess.IN_PROCESS
            from vllm.platforms import current_platform

            producer = getattr(kv_transfer_config, "kv_role", None) == "kv_producer"
            config = load_config(kv_transfer_config.kv_connector_extra_config)
            for name in kv_cache_access(config, producer=producer, on_gpu=bool(current_platform.is_cuda())):
                flags |= KVCacheAccess[name]
            return flags

    @classmethod
    def supports_lookahead_block_hashes(cls, kv_transfer_config: Any) -> bool:
        return False  # the connector never reads block hashes: D names blocks by id, P answers by transfer_id

    def may_load_async(self, request: Any) -> bool:
        return self._scheduler is not None and self._scheduler.may_load_async(request)

    # --- scheduler side ----------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return PdkvConnectorMetadata(self._scheduler.build_meta(scheduler_output))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output.finished_recving, getattr(connector_output, "failed_recving", None))

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_push_work()

    def get_loaded_kv_cache_group_ids(self, request: Any) -> tuple[int, ...]:
        # The whole prompt's blocks are written, in every (the one) group.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    # --- worker side -------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches, sorted(kv_caches, key=_layer_index))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Before the forward (start_load_kv may come after it): with socket_write_layers its writes begin here.
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, PdkvConnectorMetadata):
            self._worker.forward_begins(connector_metadata.step)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, PdkvConnectorMetadata):
            self._worker.start_step(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # the KV lands between steps, before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        # P with socket_write_layers: this layer's KV is in the cache; the writes of this step's completed prompts
        # may take it. Otherwise nothing: P writes each request once the forward completing its prompt is done.
        if self._worker is not None:
            self._worker.layer_saved(layer_name)

    def wait_for_save(self) -> None:
        # After the forward: requests whose prompt it completed start sending now (on CPU hosts the
        # worker then waits up to wait_write_ms for those writes; on GPUs it never blocks).
        assert self._worker is not None
        meta = self._connector_metadata
        if isinstance(meta, PdkvConnectorMetadata) and meta.step.prompt_done:
            self._worker.forward_done(meta.step)

    def _collect(self) -> tuple[set[str], set[str], set[str]]:
        """(sent, received, failed without blocks): this step's concluded transfers, load errors noted."""
        assert self._worker is not None
        meta = self._connector_metadata
        sent, recv = self._worker.results(idle=isinstance(meta, PdkvConnectorMetadata) and meta.step.idle)
        # A failed pull names the blocks whose KV did not (provably) arrive: vLLM recomputes from the first of
        # them (kv_load_failure_policy "recompute", keeping D's own cached prefix) or fails the request ("fail").
        # One without blocks is a pull D stopped waiting for.
        exact = {rid: blocks for rid, blocks in recv.failed_blocks.items() if blocks}
        self._load_errors.update(b for blocks in exact.values() for b in blocks)
        return sent, set(recv.finished), set(recv.failed) - exact.keys()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # vLLM 0.26 asks here: every concluded pull is received; the failed ones' blocks are load errors.
        sent, recv, _ = self._collect()
        return sent or None, recv or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # vLLM 0.32+ asks here (KVConnectorTransferResults).
        sent, recv, failed = self._collect()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recv, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # --- metrics: vLLM exports these on the engine's /metrics (pdkv.connector.prom) ----

    def get_kv_connector_stats(self) -> PdkvConnectorStats | None:
        delta = self._worker.stats() if self._worker is not None else None
        return PdkvConnectorStats.of(delta) if delta is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PdkvConnectorStats:
        return PdkvConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PdkvPromMetrics:  # fmt: skip
        return PdkvPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
