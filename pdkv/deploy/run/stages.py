"""In which order `pdkv up` starts its parts (pure): the bootstrap first, then the engines, the proxy last.

Engines start together (each pinned to its own cores on CPU): start-up is the slow part. One exception: vLLM 0.34's
extensible KV cache on a GPU sizes the cache from the memory it measures after warm-up, counting everything the
device lost since the engine started as its own. Two engines that share a GPU and start together each count the
other's weights and warm-up as theirs: the cache of one comes out smaller than its share, or empty and the engine
fails. Engines that share a GPU therefore start one after another while vLLM measures their cache.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdkv.connector import extensible_kv_cache_off
from pdkv.deploy.plan import Part

__all__ = ["gpus_of", "measures_kv_cache", "share_gpu", "start_stages"]

_FIRST = {"bootstrap": 0, "prefill": 1, "decode": 1}


def measures_kv_cache(part: Part, extensible_release: bool) -> bool:
    """Whether vLLM sizes `part`'s KV cache from memory measured after warm-up: an engine on a GPU, with a vLLM
    whose extensible KV cache exists (`extensible_release`), and no argument that fixes the size or turns it off."""
    spec = part.spec
    if part.kind not in ("prefill", "decode") or spec is None or spec.platform != "gpu" or not extensible_release:
        return False
    return not extensible_kv_cache_off(spec.extra_args)


def gpus_of(part: Part) -> frozenset[str] | None:
    """The GPUs an engine on a GPU uses (its `gpu` list), None for all of the host's."""
    gpu = part.spec.gpu if part.spec else None
    return None if gpu is None else frozenset(g.strip() for g in gpu.split(",") if g.strip())


def share_gpu(a: Part, b: Part) -> bool:
    """Whether two engines on GPUs of one host use a GPU in common."""
    if a.host != b.host or a.spec is None or b.spec is None or "gpu" != a.spec.platform or "gpu" != b.spec.platform:
        return False
    ga, gb = gpus_of(a), gpus_of(b)
    return ga is None or gb is None or bool(ga & gb)


def start_stages(parts: Sequence[Part], extensible_release: bool) -> list[int]:
    """Each part's start stage (`Supervisor` starts stage by stage, each healthy before the next): bootstrap 0,
    engines 1, the proxy after every engine. Two engines that share a GPU where vLLM measures the KV cache of either
    start one after the other, in the order the parts are listed."""
    measured = [measures_kv_cache(p, extensible_release) for p in parts]
    stages: list[int] = []
    for i, part in enumerate(parts):
        stage = _FIRST[part.kind] if part.kind in _FIRST else 0
        if part.kind in ("prefill", "decode"):
            after = [stages[j] + 1 for j in range(i)
                     if parts[j].kind in ("prefill", "decode") and (measured[i] or measured[j]) and share_gpu(part, parts[j])]
            stage = max([stage, *after])
        stages.append(stage)
    last_engine = max((s for p, s in zip(parts, stages, strict=True) if p.kind in ("prefill", "decode")), default=1)
    return [last_engine + 1 if p.kind == "proxy" else s for p, s in zip(parts, stages, strict=True)]
