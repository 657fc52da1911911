"""Worker-side hooks (steps 1-5, 14, 19, 32, 35): KV tensors in, sender or receiver running.

`ConnectorWorker` needs only numbers from vLLM (ranks, block count, the
KV tensors), so the vLLM-facing class stays a thin shell around it.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import msgspec

from pdkv.auth import sealer_from_env, token_from_env
from pdkv.connector.config import ConnectorConfig, bootstrap_bind, bootstrap_url, membership
from pdkv.connector.layer_writes import LayerBoard
from pdkv.connector.layout import TensorInfo, layer_regions, memory_ranges, regions_for_caches
from pdkv.connector.receiver import KVReceiver, Results
from pdkv.connector.scheduler import StepMeta
from pdkv.connector.sender import KVSender
from pdkv.connector.send_table import SendLimits
from pdkv.connector.timing import ConnectorDelta, TraceLog
from pdkv.wire import DEFAULT_MEMBER_TTL_S, MemberRecord, RegisterRequest

log = logging.getLogger("pdkv.connector")


def advertised_host(config: ConnectorConfig) -> str:
    """The address peers use to reach this worker: the config's, else VLLM_HOST_IP, else loopback."""
    return config.side_channel_host or os.environ.get("VLLM_HOST_IP") or "127.0.0.1"


class EngineIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """What the engine's member record says about it beyond the connector's own settings."""

    model: str = ""
    block_size: int = 0
    dp_size: int = 1
    # vLLM's --kv-events-config endpoints as bound (`tcp://*:PORT`), when the engine publishes its KV events.
    kv_events: str | None = None
    kv_events_replay: str | None = None

    def events_at(self, host: str) -> tuple[str | None, str | None]:
        """Where a subscriber on another host reaches them: the wildcard made this engine's address. With DP,
        vLLM offsets each rank's ports, so nothing is advertised (the proxy keeps an approximate view)."""
        if self.kv_events is None or self.dp_size > 1 or "*" not in self.kv_events:
            return None, None
        at = f"[{host}]" if ":" in host else host
        return self.kv_events.replace("*", at), self.kv_events_replay.replace("*", at) if self.kv_events_replay else None


class ConnectorWorker:
    def __init__(
        self,
        config: ConnectorConfig,
        *,
        engine_id: str,
        is_producer: bool,
        tp_rank: int,
        tp_size: int,
        dp_rank: int,
        num_blocks: int,
        identity: EngineIdentity | None = None,
        kv_heads: int = 0,
    ) -> None:
        """`kv_heads`: the model's KV heads, all TP ranks together (0: unknown, and only a peer of this TP size
        is served): with it P and D of different TP sizes split each block's heads between their ranks."""
        self.config = config
        self.engine_id = engine_id
        self.is_producer = is_producer
        self.tp_rank, self.tp_size, self.dp_rank, self.kv_heads = tp_rank, tp_size, dp_rank, kv_heads
        self.num_blocks = num_blocks
        self.host = advertised_host(config)
        self.transport: Any = None
        self.sender: KVSender | None = None
        self.receiver: KVReceiver | None = None
        self.trace: TraceLog | None = None  # made with the sender or the receiver
        self.bootstrap: Any = None
        self.registration: Any = None  # P: StandingRegistration, renewing this worker's bootstrap entry
        self.member: Any = None  # TP0: StandingRegistration of this engine's member record
        self.identity = identity or EngineIdentity()
        self._on_gpu = False
        self._layer_of: dict[str, int] = {}  # P writing layer by layer: layer name -> layer index
        self._forward_open = False  # P writing layer by layer: this step's forward completes prompts (model runner's)

    def register_kv_caches(self, kv_caches: dict[str, Any], layer_order: list[str]) -> None:
        """Steps 1, 3-5: start Mooncake, register the KV memory, start the side channel (P) or receiver (D)."""
        from pdkv.transport import open_transport

        if self.config.switch_interval_us:
            sys.setswitchinterval(self.config.switch_interval_us / 1e6)

        tensors = [TensorInfo.of(name, kv_caches[name]) for name in layer_order]
        self._on_gpu = getattr(getattr(kv_caches[layer_order[0]], "device", None), "type", "cpu") == "cuda"
        regions = regions_for_caches(tensors, self.num_blocks)
        log.info(
            "pdkv: %d KV regions of %d blocks x %d B (%s); first tensor %s stride %s",
            len(regions), self.num_blocks, regions[0].block_len, "producer" if self.is_producer else "consumer",
            tensors[0].shape, tensors[0].stride,
        )
        device = getattr(kv_caches[layer_order[0]], "device", None)
        self.transport = open_transport(
            self.config.transport, self.host, self.config.device_name, gpu=(device.index or 0) if self._on_gpu else None,
            writable=not self.is_producer, write_timeout_s=self.config.write_timeout_s,
            port=self.config.socket_port + self.tp_rank if self.config.socket_port else 0, connections=self.config.socket_connections,
            buffer_bytes=self.config.socket_buffer_bytes, send_process=self.is_producer and self.config.sends_from_process(self._on_gpu),
        )
        self.transport.register(memory_ranges(regions))
        role = "prefill" if self.is_producer else "decode"
        self.trace = trace = TraceLog(role, self.config.trace_dir, engine_id=self.engine_id, tp_rank=self.tp_rank)
        if not self.is_producer:
            self.receiver = KVReceiver(
                self.transport.session_address, regions, tp_rank=self.tp_rank, tp_size=self.tp_size, kv_heads=self.kv_heads,
                liveness_s=self.config.liveness_s, trace=trace,
                ipc=self.transport.hello(), sealer=sealer_from_env(), transport=self.transport,
            )
            self._join_members()
            return
        if self.config.bootstrap_server_address is None and self.tp_rank == 0 and self.dp_rank == 0:
            from pdkv.bootstrap import start_background

            host, port = bootstrap_bind(self.config)
            self.bootstrap = start_background(host, port, token=token_from_env())
            log.info("pdkv: bootstrap server listening on %s:%d", host, port)
        limits = SendLimits(unknown_wait_s=self.config.unknown_wait_s, expiry_s=self.config.expiry_s)
        board = None
        if self.config.writes_layers(self._on_gpu):
            self._layer_of, groups = layer_regions(tensors, self.num_blocks, regions)
            board = LayerBoard(groups, wait_s=self.config.write_timeout_s, groups=self.config.socket_layer_groups)
            log.info("pdkv: P writes KV layer by layer as the forward computes them: %d layers in %d writes",
                     len(groups), len(board.ends))
        self.sender = KVSender(
            self.transport, regions, host=self.host, tp_rank=self.tp_rank, tp_size=self.tp_size, kv_heads=self.kv_heads,
            engine_id=self.engine_id, limits=limits, heartbeat_s=self.config.heartbeat_s, trace=trace,
            wait_write_s=0.0 if self._on_gpu else self.config.wait_write_ms / 1000, sealer=sealer_from_env(),
            port=self.config.side_channel_port + self.dp_rank * self.tp_size + self.tp_rank if self.config.side_channel_port else 0,
            layers=board,
        )
        self._register_with_bootstrap()
        self._join_members()

    def _register_with_bootstrap(self) -> None:
        from pdkv.connector.registration import StandingRegistration

        assert self.sender is not None
        url = bootstrap_url(self.config, self.host)
        req = RegisterRequest(engine_id=self.engine_id, dp_rank=self.dp_rank, tp_rank=self.tp_rank, pp_rank=0, addr=self.sender.address)
        what = f"{self.engine_id}'s side channel"
        self.registration = StandingRegistration(url, lambda bs: bs.register(req), what, self.config.register_interval_s)
        log.info("pdkv: registered %s (tp %d) side channel %s at %s", self.engine_id, self.tp_rank, self.sender.address, url)

    def _join_members(self) -> None:
        """TP0: join the members registry, if the engine has one and knows its own URL (see ConnectorConfig)."""
        from pdkv.connector.registration import StandingRegistration

        where = membership(self.config, is_producer=self.is_producer)
        if where is None or self.tp_rank != 0:
            return
        members_url, advertise = where
        events = self.identity.events_at(self.host)
        interval = self.config.register_interval_s
        record = MemberRecord(
            member_id=self.engine_id, role="prefill" if self.is_producer else "decode", url=advertise,
            bootstrap_url=bootstrap_url(self.config, self.host) if self.is_producer else None,
            dp_rank=self.dp_rank, dp_size=max(self.identity.dp_size, self.dp_rank + 1), tp_size=self.tp_size,
            model=self.identity.model, block_size=self.identity.block_size, connector="pdkv",
            transport=self.config.transport, kv_events=events[0], kv_events_replay=events[1],
            ttl_s=max(3 * interval, DEFAULT_MEMBER_TTL_S) if interval > 0 else 3600.0,
        )
        self.member = StandingRegistration(
            members_url, lambda bs: bs.join(record), f"member {self.engine_id}", interval, required=False,
            on_close=lambda bs: bs.leave(record.member_id),
        )
        log.info("pdkv: %s joins the members registry at %s as %s %s", self.engine_id, members_url, record.role, advertise)

    def start_step(self, meta: StepMeta) -> None:
        """Steps 14 and 19: hand the scheduler's news to the sender or receiver; never blocks."""
        if self.sender is not None:
            self.sender.apply_step(meta.registered, meta.ready, meta.cancelled, meta.ready_at, scheduled_at=meta.at,
                                   fanout=meta.fanout, bindings=meta.bindings)
        if self.receiver is not None:
            self.receiver.apply_step(meta.pulls, meta.aborts, meta.first_tokens, meta.releases)

    def forward_begins(self, meta: StepMeta) -> None:
        """Before the forward, writing layer by layer (P): the requests whose prompt it completes may be sent from
        now on, each layer as `layer_saved` reports it. Their transfers' bindings and choices (n) are known before any
        send starts: vLLM binds a step's metadata (here) before start_load_kv (start_step)."""
        if self.sender is None or not self._layer_of or not meta.prompt_done:
            return
        self.sender.apply_step(bindings=meta.bindings, fanout=meta.fanout)
        self.sender.prompt_starts(meta.prompt_done, self._fence() if self._forward_open else None)
        self._forward_open = True

    def layer_saved(self, layer_name: str) -> None:
        """vLLM saved `layer_name`'s KV during the forward (save_kv_layer). Writing layer by layer with a forward that
        completes prompts, its writes may take that layer: on a GPU once an event recorded here (on the forward's
        stream) has completed, which the writer thread waits for; on a CPU the KV is there now."""
        if self._forward_open and (layer := self._layer_of.get(layer_name)) is not None:
            assert self.sender is not None
            self.sender.layer_ready(layer, self._fence())

    def forward_done(self, meta: StepMeta) -> None:
        """After the forward: start sending the requests whose prompt it completed (P); writing layer by layer,
        their writes started with the forward and may now take every layer.

        On a GPU the forward may still be running: the write waits on an event recorded here and this
        returns at once. With the KV in host memory this waits up to wait_write_ms for those writes."""
        self._forward_open = False
        if self.sender is None or not meta.prompt_done:
            return
        self.sender.prompt_done(meta.prompt_done, self._fence())

    def _fence(self) -> Any:
        if not self._on_gpu:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record()
        return ev

    def results(self, idle: bool = False) -> tuple[set[str], Results]:
        """Steps 32 and 35: (P requests whose blocks may be freed, D pulls concluded).

        `idle`: this step computed nothing, so D may wait (idle_wait_ms) for a pull in flight, and P holding
        blocks for D in host memory may wait (hold_wait_ms) for a send to conclude, giving its core back
        meanwhile (on a GPU host the cores are not what the engines share, and the wait would only delay
        new requests)."""
        if idle and self.receiver is not None:
            self.receiver.wait_results(self.config.idle_wait_ms / 1000)
        if idle and self.sender is not None and not self._on_gpu:
            self.sender.wait_finished(self.config.hold_wait_ms / 1000)
        sent = self.sender.take_finished() if self.sender is not None else set()
        recv = self.receiver.take_results() if self.receiver is not None else Results()
        for rid, why in recv.failed.items():
            log.error("pdkv: request %s fails: KV transfer %s: %s", rid, recv.transfer_ids.get(rid, "?"), why)
        return sent, recv

    def stats(self) -> ConnectorDelta | None:
        """What this rank counted since the last call, for vLLM's connector stats (pdkv.connector.prom)."""
        return self.trace.take_stats() if self.trace is not None else None

    def close(self) -> None:
        for registration in (self.member, self.registration):
            if registration is not None:
                registration.close()
        for part in (self.sender, self.receiver):
            if part is not None:
                part.close()
        if self.transport is not None:
            self.transport.close()
        if self.bootstrap is not None:
            self.bootstrap.stop()
