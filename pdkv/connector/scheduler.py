"""Scheduler-side hooks (steps 11-13, 16-18, 23, 33, 36-37), without importing vLLM.

`ConnectorScheduler` reads duck-typed vLLM Request / KVCacheBlocks objects
and produces one `StepMeta` per scheduler step for the workers.

The rule that replaces the step-23 defect of vLLM's connector (docs/timeline.md): P sends whenever its
request finished with the whole prompt computed, whether it stopped by
length, by EOS or by a stop token. A P request that ends any other way
(aborted, error, prompt not computed) is reported to the worker as
cancelled, which answers D's pull with an error at once.

P does not wait for that finish to start sending: a one-token P request
(the proxy's kind) is announced to the workers as `prompt_done` in the step
whose forward completes its prompt, so the worker starts the write right
after that forward, while P still samples its token. Such a request's
blocks stay held after it finishes, whatever its status, until the
worker reports the send over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from pdkv.connector.config import ParamsError, check_decode_params, classify_params
from pdkv.connector.pulls import PullSpec
from pdkv.geometry import blocks_for
from pdkv.wire import DecodeParams, PrefillParams

log = logging.getLogger("pdkv.connector")

# vLLM's RequestStatus names for a finish that leaves the prompt's KV complete and valid.
SENDABLE_FINISHES = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


@dataclass
class StepMeta:
    """What the scheduler tells every worker in one step."""

    registered: dict[str, str] = field(default_factory=dict)  # P: p_req_id -> transfer_id
    bindings: dict[str, str] = field(default_factory=dict)  # P: transfer_id -> commitment to its D's binding secret
    fanout: dict[str, int] = field(default_factory=dict)  # P: transfer_id -> D requests pulling it, where more than one
    prompt_done: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # P: prompt complete after this step's forward
    ready: dict[str, tuple[str, list[int]]] = field(default_factory=dict)  # P: p_req_id -> (transfer_id, blocks)
    ready_at: dict[str, float] = field(default_factory=dict)  # P: p_req_id -> unix time the scheduler saw it finish (step 23)
    cancelled: dict[str, str] = field(default_factory=dict)  # P: transfer_id -> reason
    pulls: list[PullSpec] = field(default_factory=list)  # D
    aborts: list[str] = field(default_factory=list)  # D: d_req_ids whose pull is no longer wanted
    releases: list[PullSpec] = field(default_factory=list)  # D: requests that will never pull (ended first, or all local)
    first_tokens: dict[str, tuple[float, int]] = field(default_factory=dict)  # D: d_req_id -> (unix time, tokens computed)
    at: float = 0.0  # unix time the scheduler built this step
    idle: bool = False  # nothing is computed in this step (D: the worker may wait for pulls to conclude)

    def empty(self) -> bool:
        return not (
            self.registered or self.bindings or self.prompt_done or self.ready or self.cancelled or self.pulls or self.aborts
            or self.releases or self.first_tokens
        )


@dataclass
class _Prefill:
    """A P request whose KV will be sent: its transfer, its blocks so far, whether the worker was told it is computed."""

    transfer_id: str
    request: Any
    blocks: list[int] = field(default_factory=list)
    early: bool = False


def _max_tokens(request: Any) -> int | None:
    sp = getattr(request, "sampling_params", None)
    n = getattr(request, "max_tokens", None)
    if n is None and sp is not None:
        n = getattr(sp, "max_tokens", None)
    return n if isinstance(n, int) else None


def _pulls_of(rid: str, params: dict[str, Any]) -> tuple[int, str]:
    """(how many D requests will pull this P request's KV (the client's `n`), the commitment binding it to its D);
    (1, "") when the params say nothing valid."""
    try:
        _, p = classify_params({k: v for k, v in params.items() if not k.startswith("_pdkv")})
    except ParamsError as exc:
        log.error("pdkv: prefill request %s: %s; serving one pull", rid, exc)
        return 1, ""
    return (p.pulls, p.decode_binding) if isinstance(p, PrefillParams) else (1, "")


def _status_name(request: Any) -> str:
    status = getattr(request, "status", None)
    return getattr(status, "name", str(status))


class ConnectorScheduler:
    def __init__(self, *, is_producer: bool, is_consumer: bool, block_size: int) -> None:
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.block_size = block_size
        self._next = StepMeta()
        self._local_hit: dict[str, int] = {}  # D: request id -> block-aligned local prefix tokens
        self._pulling: set[str] = set()  # D: pulls started and not yet reported
        self._arrived: set[str] = set()  # D: KV arrived, first token not yet scheduled
        self._prefills: dict[str, _Prefill] = {}  # P: registered requests not yet finished

    # --- both -------------------------------------------------------------

    def may_load_async(self, request: Any) -> bool:
        """Whether `get_num_new_matched_tokens` may answer this request asynchronously: a remote prefill on a D.
        Cheap (vLLM asks whenever the request enters a waiting queue); never true on P, where vLLM's default
        (the params' do_remote_prefill alone) would hold other async loads back for nothing."""
        params = request.kv_transfer_params
        return self.is_consumer and bool(params and params.get("do_remote_prefill"))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if not self.is_consumer:
            log.error(
                "pdkv: request %s asks for remote prefill on an engine that is not kv_consumer; computing it here", request.request_id
            )
            return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        if count <= 0:
            return 0, False
        self._local_hit[request.request_id] = num_computed_tokens
        return count, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        rid = request.request_id
        if params.get("do_remote_prefill") and self.is_consumer:
            local = self._local_hit.pop(rid, 0)
            if num_external_tokens <= 0:
                self._release(request, "decode had the whole prompt cached")
                params["do_remote_prefill"] = False  # one transfer per request
                return
            spec = self._pull_spec(request, blocks, local)
            params["do_remote_prefill"] = False
            self._next.pulls.append(spec)
            self._pulling.add(rid)
        elif params.get("do_remote_decode") and self.is_producer and not params.get("_pdkv_registered"):
            tid = params.get("transfer_id")
            if isinstance(tid, str) and tid:
                params["_pdkv_registered"] = True
                self._next.registered[rid] = tid
                pulls, commitment = _pulls_of(rid, params)
                if pulls > 1:
                    self._next.fanout[tid] = pulls
                if commitment:
                    self._next.bindings[tid] = commitment
                (ids, *_) = blocks.get_block_ids() or ([],)
                self._prefills[rid] = _Prefill(tid, request, list(ids))
            else:
                log.error("pdkv: prefill request %s has do_remote_decode without a transfer_id; its KV will not be sent", rid)

    def _release(self, request: Any, reason: str) -> None:
        """Tell P (through the worker) that this D request will not pull; invalid params have no P to tell."""
        try:
            role, p = classify_params(request.kv_transfer_params)
            if role != "decode" or not isinstance(p, DecodeParams):
                return
            check_decode_params(p)
        except ParamsError:
            return
        log.info("pdkv: request %s releases transfer %s: %s", request.request_id, p.transfer_id, reason)
        self._next.releases.append(
            PullSpec(request.request_id, p.transfer_id, p.remote_bootstrap_addr, p.remote_engine_id, [], binding=p.binding)
        )

    def _pull_spec(self, request: Any, blocks: Any, local_tokens: int) -> PullSpec:
        rid = request.request_id
        first = local_tokens // self.block_size
        wanted = blocks_for(len(request.prompt_token_ids or ()), self.block_size)
        (all_ids,) = blocks.get_block_ids()
        block_ids = list(all_ids[first:wanted])
        tid = str((request.kv_transfer_params or {}).get("transfer_id") or "")
        try:
            role, p = classify_params(request.kv_transfer_params)
            if role != "decode" or not isinstance(p, DecodeParams):
                raise ParamsError("kv_transfer_params do not describe a decode request")
            check_decode_params(p)
        except ParamsError as exc:
            log.error("pdkv: request %s: %s", rid, exc)
            return PullSpec(rid, tid or f"invalid-{rid}", "", "", block_ids, first, error=str(exc))
        return PullSpec(rid, p.transfer_id, p.remote_bootstrap_addr, p.remote_engine_id, block_ids, first, binding=p.binding)

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Return (delay_free, params): P keeps the blocks of a request whose KV it will send."""
        params = request.kv_transfer_params
        rid = request.request_id
        pre = self._prefills.pop(rid, None)
        if not params:
            return False, None
        if self.is_consumer and rid in self._pulling:
            # D's request ended while its KV is still coming: tell P to stop.
            # vLLM itself holds these blocks until the pull is reported done.
            self._next.aborts.append(rid)
            return False, None
        if self.is_consumer and params.get("do_remote_prefill"):
            # D's request ended before it was scheduled: it will never pull, so P may free its blocks now.
            self._release(request, f"decode request ended ({_status_name(request)}) before it pulled")
            params["do_remote_prefill"] = False
            self._local_hit.pop(rid, None)
            return False, None
        self._arrived.discard(rid)
        if not (self.is_producer and params.get("do_remote_decode")):
            return False, None
        tid = params.get("transfer_id")
        if not isinstance(tid, str) or not tid:
            return False, None
        status = _status_name(request)
        prompt_done = request.num_computed_tokens >= request.num_prompt_tokens
        # A request announced as prompt_done may be mid-send: it keeps its blocks whatever ended it.
        if (status in SENDABLE_FINISHES or (pre is not None and pre.early)) and prompt_done and block_ids:
            wanted = blocks_for(request.num_prompt_tokens, self.block_size)
            self._next.ready[rid] = (tid, list(block_ids[:wanted]))
            self._next.ready_at[rid] = time.time()
            return True, None
        reason = f"prefill request {rid} finished as {status}" + ("" if prompt_done else " before its prompt was computed")
        log.warning("pdkv: %s; telling the decode side not to wait for %s", reason, tid)
        self._next.cancelled[tid] = reason
        return False, None

    def update_connector_output(self, finished_recving: set[str] | None, failed_recving: set[str] | None) -> None:
        failed = failed_recving or set()
        for rid in finished_recving or ():
            if rid in self._pulling:
                self._pulling.discard(rid)
                if rid not in failed:
                    self._arrived.add(rid)

    def build_meta(self, output: Any = None) -> StepMeta:
        """Everything gathered since the last step, for vLLM's SchedulerOutput `output`; sent to the workers.

        Called before vLLM adds this step's tokens to `num_computed_tokens`."""
        meta, self._next = self._next, StepMeta()
        meta.at = time.time()
        meta.idle = getattr(output, "total_num_scheduled_tokens", None) == 0
        num_scheduled_tokens = getattr(output, "num_scheduled_tokens", None)
        if self._prefills and num_scheduled_tokens:
            self._announce_prompt_done(output, num_scheduled_tokens, meta)
        if self._arrived and num_scheduled_tokens:
            now = time.time()
            for rid in [r for r in self._arrived if r in num_scheduled_tokens]:
                meta.first_tokens[rid] = (now, num_scheduled_tokens[rid])
                self._arrived.discard(rid)
        return meta

    def _announce_prompt_done(self, output: Any, scheduled: dict[str, int], meta: StepMeta) -> None:
        """Track P requests' blocks from this step's output; announce those whose prompt this step completes."""
        for new in getattr(output, "scheduled_new_reqs", None) or ():
            pre = self._prefills.get(new.req_id)
            if pre is not None:
                pre.blocks = list(new.block_ids[0])
        cached = getattr(output, "scheduled_cached_reqs", None)
        if cached is not None:
            resumed = getattr(cached, "resumed_req_ids", None) or set()
            for rid, ids in zip(cached.req_ids, cached.new_block_ids, strict=False):
                pre = self._prefills.get(rid)
                if pre is None or ids is None:
                    continue
                pre.blocks = list(ids[0]) if rid in resumed else pre.blocks + list(ids[0])
        for rid, pre in self._prefills.items():
            n = scheduled.get(rid)
            if n is None or pre.early:
                continue
            r = pre.request
            # Only a one-token request surely finishes in this step, so nothing can preempt it mid-send.
            if r.num_computed_tokens + n < r.num_prompt_tokens or _max_tokens(r) != 1:
                continue
            wanted = blocks_for(r.num_prompt_tokens, self.block_size)
            if len(pre.blocks) < wanted:
                continue
            pre.early = True
            meta.prompt_done[rid] = (pre.transfer_id, pre.blocks[:wanted])

    def has_pending_push_work(self) -> bool:
        """True while news for the workers waits: keeps an idle engine stepping so it gets delivered."""
        return not self._next.empty()
