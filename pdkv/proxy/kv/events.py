"""vLLM's KV cache events, decoded tolerantly into pdkv's own small records (pure: no sockets).

An engine started with `--kv-events-config` publishes on a ZMQ PUB socket
multipart messages (topic, 8-byte big-endian sequence number, payload); the
payload is a msgpack EventBatch `[ts, [event, ...], data_parallel_rank?]`.
vLLM versions encode an event two ways, and both are read here:

- tagged map (vLLM 0.32): `{"type": "BlockStored", "block_hashes": [...], ...}`
- positional (array_like, earlier releases): `["BlockStored", block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, ...]`, `["BlockRemoved", block_hashes, medium, ...]`,
  `["AllBlocksCleared"]`

Fields this module does not know are ignored; an event of an unknown type
is counted and skipped; a payload that is not an EventBatch at all raises
`EventDecodeError`, which the subscriber counts (one bad message never
stops the stream). Block hashes are bytes (sha256 by default) or ints
(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES); both are opaque keys here.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdkv.errors import EventDecodeError

EngineHash = bytes | int
# Mediums whose blocks serve a prefix hit at the next request (the engine's own KV cache). vLLM names its
# device cache "GPU" on every platform; offloading tiers (CPU, STORAGE) are not a hit the scheduler takes.
PRIMARY_MEDIUMS = (None, "GPU")
END_SEQ = -1  # the replay socket's end-of-replay marker


class BlockStored(msgspec.Struct, frozen=True):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True):
    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True):
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, frozen=True):
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    unknown: int = 0  # events of a type this module does not read


_unpack = msgspec.msgpack.Decoder().decode
_POSITIONAL: dict[str, tuple[str, ...]] = {
    # vLLM's field order for array_like events (lora_id sat where lora_name now is named; it is skipped).
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name", "extra_keys",
                    "group_idx"),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}
_TYPES: dict[str, type[Event]] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved, "AllBlocksCleared": AllBlocksCleared}


def _hashes(value: Any) -> list[EngineHash]:
    if not isinstance(value, list) or not all(isinstance(h, bytes | int) and not isinstance(h, bool) for h in value):
        raise EventDecodeError("block_hashes is not a list of bytes or ints")
    return value


def _event(raw: Any) -> Event | None:
    """One event from either encoding, or None when its type is unknown."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _POSITIONAL.get(kind, ())
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventDecodeError(f"an event is neither a tagged map nor a tagged array: {type(raw).__name__}")
    cls = _TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return None
    if cls is AllBlocksCleared:
        return AllBlocksCleared()
    if cls is BlockRemoved:
        return BlockRemoved(_hashes(fields.get("block_hashes")), _str_or_none(fields.get("medium")), _int_or_none(fields.get("group_idx")))
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise EventDecodeError("BlockStored.token_ids is not a list of ints")
    if not isinstance(size, int) or size <= 0:
        raise EventDecodeError(f"BlockStored.block_size {size!r} is not a positive int")
    parent = fields.get("parent_block_hash")
    if parent is not None and not isinstance(parent, bytes | int):
        raise EventDecodeError("BlockStored.parent_block_hash is not bytes, an int or null")
    extra = fields.get("extra_keys")
    return BlockStored(
        block_hashes=_hashes(fields.get("block_hashes")),
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=size,
        lora_name=_str_or_none(fields.get("lora_name")),
        medium=_str_or_none(fields.get("medium")),
        extra_keys=extra if isinstance(extra, list) else None,
        group_idx=_int_or_none(fields.get("group_idx")),
    )


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def decode_batch(payload: bytes) -> EventBatch:
    """One published payload as an EventBatch; raises EventDecodeError if it is not one."""
    try:
        raw = _unpack(payload)
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    if isinstance(raw, dict):  # a map-encoded batch, should a version write one
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    elif isinstance(raw, list) and len(raw) >= 2:
        ts, events, rank = raw[0], raw[1], raw[2] if len(raw) > 2 else None
    else:
        raise EventDecodeError("the payload is not an EventBatch [ts, events, dp_rank]")
    if not isinstance(ts, int | float) or not isinstance(events, list):
        raise EventDecodeError("EventBatch has no timestamp or no event list")
    out: list[Event] = []
    unknown = 0
    for item in events:
        event = _event(item)
        if event is None:
            unknown += 1
        else:
            out.append(event)
    return EventBatch(float(ts), out, _int_or_none(rank), unknown)


def extra_of(event: BlockStored, i: int) -> Any:
    """What besides tokens named block i in vLLM's hash (LoRA, multimodal ids, cache salt), or None."""
    extra = event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
    if event.lora_name is None and not extra:
        return None
    return (event.lora_name, tuple(extra) if isinstance(extra, list) else extra)


def parse_seq(frame: bytes) -> int:
    """The sequence number frame (8 bytes, big-endian, signed: the replay's end marker is -1)."""
    if len(frame) != 8:
        raise EventDecodeError(f"a sequence frame of {len(frame)} bytes (8 expected)")
    return int.from_bytes(frame, "big", signed=True)
