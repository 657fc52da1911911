"""The order `pdkv up` starts its parts (pdkv.deploy.run.stages): engines together, except engines sharing a GPU while
vLLM 0.34's extensible KV cache measures their cache after warm-up, which start one after another."""

from __future__ import annotations

from pdkv.deploy import deployment_parts
from pdkv.deploy.plan.loader import deployment_from_dict
from pdkv.deploy.run.stages import measures_kv_cache, start_stages


def _parts(prefill: list[dict], decode: list[dict], platform: str = "gpu"):
    return deployment_parts(deployment_from_dict(
        {"model": "/m", "host_ip": "10.0.0.5", "platform": platform, "prefill": prefill, "decode": decode}))


def _stages(parts, extensible: bool) -> dict[str, int]:
    return {p.launch.name: s for p, s in zip(parts, start_stages(parts, extensible), strict=True)}


def test_engines_on_one_gpu_start_one_after_another_where_vllm_measures_the_cache():
    parts = _parts([{"port": 8100, "gpu": "0"}], [{"port": 8200, "gpu": "0"}])
    stages = _stages(parts, extensible=True)
    engines = [p for p in parts if p.kind in ("prefill", "decode")]
    assert sorted(stages[p.launch.name] for p in engines) == [1, 2]
    proxy = next(p for p in parts if p.kind == "proxy")
    assert stages[proxy.launch.name] == 3
    # vLLM before 0.34 reserves a fixed share: together, as always.
    assert sorted(_stages(parts, extensible=False)[p.launch.name] for p in engines) == [1, 1]


def test_engines_on_separate_gpus_or_with_a_fixed_cache_start_together():
    separate = _parts([{"port": 8100, "gpu": "0"}], [{"port": 8200, "gpu": "1"}])
    assert [s for p, s in zip(separate, start_stages(separate, True), strict=True) if p.kind in ("prefill", "decode")] == [1, 1]
    fixed = ["--kv-cache-memory-bytes", "4294967296"]
    both_fixed = _parts([{"port": 8100, "gpu": "0", "extra_args": fixed}], [{"port": 8200, "gpu": "0", "extra_args": fixed}])
    assert not any(measures_kv_cache(p, True) for p in both_fixed)
    assert [s for p, s in zip(both_fixed, start_stages(both_fixed, True), strict=True) if p.kind in ("prefill", "decode")] == [1, 1]
    # One measured engine is enough: the fixed one's allocations would count as the measured one's.
    one_fixed = _parts([{"port": 8100, "gpu": "0", "extra_args": ["--kv-cache-memory-bytes=4294967296"]}], [{"port": 8200, "gpu": "0"}])
    assert [s for p, s in zip(one_fixed, start_stages(one_fixed, True), strict=True) if p.kind in ("prefill", "decode")] == [1, 2]


def test_a_gpu_list_overlapping_another_and_an_engine_with_every_gpu():
    parts = _parts([{"port": 8100, "gpu": "0,1", "tp": 2}, {"port": 8101, "gpu": "2"}], [{"port": 8200, "gpu": "1,2", "tp": 2}])
    engines = {p.launch.name: s for p, s in zip(parts, start_stages(parts, True), strict=True) if p.kind in ("prefill", "decode")}
    assert sorted(engines.values()) == [1, 1, 2]  # the two prefills share nothing; the decode waits for both
    anywhere = _parts([{"port": 8100}], [{"port": 8200, "gpu": "3"}])
    assert sorted(s for p, s in zip(anywhere, start_stages(anywhere, True), strict=True) if p.kind in ("prefill", "decode")) == [1, 2]


def test_cpu_engines_always_start_together():
    parts = _parts([{"port": 8100}], [{"port": 8200}], platform="cpu")
    assert not any(measures_kv_cache(p, True) for p in parts)
    assert sorted(s for p, s in zip(parts, start_stages(parts, True), strict=True) if p.kind in ("prefill", "decode")) == [1, 1]


def test_preflight_wants_a_memory_share_for_each_engine_on_a_shared_gpu():
    from pdkv.deploy.run.preflight import check_gpu_shares

    unset = _parts([{"port": 8100, "gpu": "0"}], [{"port": 8200, "gpu": "0", "extra_args": ["--gpu-memory-utilization", "0.4"]}])
    [problem] = check_gpu_shares(unset)
    assert "prefill-0 takes vLLM's default share" in problem.what and "--gpu-memory-utilization" in problem.fix
    too_much = _parts([{"port": 8100, "gpu": "0", "extra_args": ["--gpu-memory-utilization=0.6"]}],
                      [{"port": 8200, "gpu": "0,1", "tp": 2, "extra_args": ["--gpu-memory-utilization", "0.5"]}])
    [problem] = check_gpu_shares(too_much)
    assert "GPU 0" in problem.what and "1.10" in problem.what
    fine = _parts([{"port": 8100, "gpu": "0", "extra_args": ["--gpu-memory-utilization", "0.45"]}],
                  [{"port": 8200, "gpu": "0", "extra_args": ["--gpu-memory-utilization", "0.45"]}])
    apart = _parts([{"port": 8100, "gpu": "0"}], [{"port": 8200, "gpu": "1"}])
    assert check_gpu_shares(fine) == [] and check_gpu_shares(apart) == []
    assert check_gpu_shares(_parts([{"port": 8100}], [{"port": 8200}], platform="cpu")) == []
