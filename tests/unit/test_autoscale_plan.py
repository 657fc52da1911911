"""What `pdkv up -f` with [autoscale] plans beyond the file (pdkv.deploy.plan.added_engines), the autoscaler's rules
(pdkv.deploy.run.scale_policy) and the proxy flags it hands the planner (pdkv.deploy.plan.topology.planner_args,
pdkv.proxy.config.planner_values): pure."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from pdkv.deploy import deployment_parts
from pdkv.deploy.plan.loader import deployment_from_dict
from pdkv.deploy.plan.ports import allocate_ports
from pdkv.deploy.plan.cores import least_bound_cores
from pdkv.deploy.plan.added_engines import added_entry, added_slot_parts, autoscaled
from pdkv.deploy.run.scale_policy import RetryBackoff, scale_steps
from pdkv.errors import ConfigError
from pdkv.proxy.config import PlannerConfig, build_config, planner_values
from support.planner_profiles import write_profile

AUTO = {"profile": "tiny.profile.json", "ttft_ms": 300, "itl_ms": 40, "interval_s": 2, "down_after_s": 20,
        "prefill": {"min": 1, "max": 3, "omp_bind": ["1", "2-3"]}}


def dep_dict(**kw) -> dict:
    base = {"model": "/m", "platform": "cpu", "host": "127.0.0.1", "host_ip": "127.0.0.1", "transport": "cma", "block_size": 32,
            "bootstrap": {"port": 9000}, "prefill": [{"port": 8100, "omp_bind": "0", "extra_args": ["--enforce-eager"]}],
            "decode": [{"port": 8200, "omp_bind": "1"}], "proxy": {"port": 8000}, "autoscale": AUTO}
    return {**base, **kw}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_proxy_runs_the_planner_with_the_tables_targets_bounds_and_waits():
    proxy = deployment_parts(deployment_from_dict(dep_dict()))[-1]
    argv = proxy.launch.argv
    assert flag(argv, "--planner-profile") == "tiny.profile.json" and flag(argv, "--slo") == "ttft=300,itl=40"
    assert flag(argv, "--planner-bounds") == "prefill=1:3,decode=1:1" and flag(argv, "--planner-interval") == "2"
    assert flag(argv, "--planner-waits") == "up=0,down=20,margin=0.8"
    values = planner_values(flag(argv, "--planner-profile"), flag(argv, "--slo"), quantile=float(flag(argv, "--slo-quantile")),
                            interval=2.0, bounds=flag(argv, "--planner-bounds"), waits=flag(argv, "--planner-waits"))
    planner = msgspec.convert(values, PlannerConfig)
    assert (planner.ttft_ms, planner.itl_ms, planner.min_prefill, planner.max_prefill, planner.max_decode) == (300, 40, 1, 3, 1)
    assert (planner.down_after_s, planner.down_margin, planner.interval_s) == (20, 0.8, 2)
    without = deployment_parts(deployment_from_dict(dep_dict(autoscale=None)))[-1]
    assert "--planner-profile" not in without.launch.argv


@pytest.mark.parametrize(("slo", "bounds", "waits", "match"), [
    ("ttft=300", None, None, "needs both ttft and itl"),
    ("ttft=300,itl=x", None, None, "not a number"),
    ("ttft=300,itl=40,tpot=3", None, None, "takes ttft and itl"),
    ("ttft=300,itl=40", "prefill=3", None, "prefill=MIN:MAX"),
    ("ttft=300,itl=40", "encode=1:2", None, "prefill=MIN:MAX"),
    ("ttft=300,itl=40", None, "sideways=3", "up, down and margin"),
])
def test_planner_flags_that_do_not_parse_are_one_line_errors(slo, bounds, waits, match):
    with pytest.raises(ConfigError, match=match):
        planner_values("p.json", slo, bounds=bounds, waits=waits)


@pytest.mark.parametrize(("planner", "match"), [
    ({"ttft_ms": 0}, "above 0 ms"),
    ({"quantile": 1.0}, "quantile"),
    ({"interval_s": 10, "window_s": 5}, "window >= interval"),
    ({"min_prefill": 3, "max_prefill": 2}, "prefill bounds"),
    ({"down_margin": 1.5}, "down_margin"),
])
def test_the_proxy_refuses_a_planner_it_cannot_run(planner, match):
    with pytest.raises(ConfigError, match=match):
        build_config(["http://127.0.0.1:1"], ["http://127.0.0.1:2"], planner={"profile": "p", "ttft_ms": 300, "itl_ms": 40, **planner})


def test_an_added_prefill_takes_the_roles_settings_its_reserved_ports_cores_and_bootstrap(tmp_path: Path):
    dep = deployment_from_dict(dep_dict())
    ports = allocate_ports(dep)
    entry = added_entry(dep, "prefill", 1, {0: 1, 1: 1})
    assert (entry.omp_bind, entry.extra_args) == ("2-3", ["--enforce-eager"])
    boot, engine = added_slot_parts(dep, ports, "prefill", 2, entry)
    assert (boot.launch.name, engine.launch.name) == ("bootstrap-2", "prefill-2")
    assert [(u.port, u.what) for u in boot.ports] == [(9002, "bootstrap")] and engine.bootstrap_url == "http://127.0.0.1:9002"
    assert engine.launch.url == "http://127.0.0.1:8102" and engine.launch.cpus == [2, 3]
    # KV events after the listed engines' (prefill-0 5557-8, decode-0 5559-60) and prefill-1's, then the side channels.
    assert engine.spec.kv_events_port == 5563 and engine.spec.connector_extra == {"side_channel_port": 5567}
    assert engine.ports == ports.of("prefill-2")
    listed = deployment_parts(dep)
    first = next(p for p in listed if p.launch.name == "prefill-0")
    # It joins the members registry the listed engines join, so the proxy routes to it without a restart.
    assert engine.launch.env["PDKV_MEMBERS_URL"] == first.launch.env["PDKV_MEMBERS_URL"] == "http://127.0.0.1:9000"
    assert engine.launch.env["PDKV_ADVERTISE_URL"] == engine.launch.url
    (decode,) = added_slot_parts(dep, ports, "decode", 1, added_entry(dep, "decode", 0, {})) if "decode-1" in ports.slots else (None,)
    assert decode is None  # [autoscale.decode] max is 1: no decode is ever added, so none has ports
    with pytest.raises(ConfigError, match="past"):
        added_slot_parts(dep, ports, "decode", 1, added_entry(dep, "decode", 0, {}))
    grown = deployment_from_dict(dep_dict(autoscale={**AUTO, "decode": {"min": 1, "max": 2}}))
    (decode,) = added_slot_parts(grown, allocate_ports(grown), "decode", 1, added_entry(grown, "decode", 0, {}))
    assert decode.launch.name == "decode-1" and decode.launch.env["PDKV_MEMBERS_URL"] == "http://127.0.0.1:9000"
    assert decode.launch.url == "http://127.0.0.1:8201"


def test_without_a_core_list_an_added_engine_takes_the_least_bound_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3})
    assert least_bound_cores({0: 2, 1: 1, 2: 1, 3: 2}, 1) == "2"  # a tie goes to the higher core
    assert least_bound_cores({0: 1, 1: 1}, 2) == "2,3"
    dep = deployment_from_dict(dep_dict(autoscale={**AUTO, "prefill": {"min": 1, "max": 2}}))
    assert added_entry(dep, "prefill", 0, {0: 1, 1: 1}).omp_bind == "3"


def test_on_a_gpu_host_each_added_engine_needs_its_gpus(tmp_path: Path):
    gpu = dep_dict(platform="gpu", transport="tcp", prefill=[{"port": 8100, "gpu": "0"}], decode=[{"port": 8200, "gpu": "1"}])
    write_profile(tmp_path / "tiny.profile.json")
    (tmp_path / "deploy.toml").touch()
    with pytest.raises(ConfigError, match=r"may add 2 engine\(s\) and names 0 gpu"):
        autoscaled(deployment_from_dict(gpu), tmp_path / "deploy.toml")
    named = deployment_from_dict({**gpu, "autoscale": {**AUTO, "prefill": {"min": 1, "max": 3, "gpu": ["2", "3"]}}})
    dep, notes = autoscaled(named, tmp_path / "deploy.toml")
    assert notes == [] and added_entry(dep, "prefill", 1, {}).gpu == "3"


def test_the_profile_is_found_beside_the_file_and_must_load(tmp_path: Path):
    deploy = tmp_path / "deploy.toml"
    with pytest.raises(ConfigError, match="cannot read profile"):
        autoscaled(deployment_from_dict(dep_dict()), deploy)
    write_profile(tmp_path / "tiny.profile.json")
    dep, _ = autoscaled(deployment_from_dict(dep_dict()), deploy)
    assert dep.autoscale is not None and dep.autoscale.profile == str(tmp_path.resolve() / "tiny.profile.json")
    with pytest.raises(ConfigError, match='connector = "pdkv"'):
        autoscaled(deployment_from_dict(dep_dict(connector="mooncake", transport="tcp")), deploy)
    fleet = dep_dict(hosts=[{"name": "a", "address": "10.0.0.1"}], prefill=[{"port": 8100, "host": "a"}],
                     decode=[{"port": 8200, "host": "a"}], proxy={"port": 8000, "host": "a"}, bootstrap={"port": 9000, "host": "a"})
    same, notes = autoscaled(deployment_from_dict(fleet), deploy)
    assert "pdkv k8s render" in notes[0] and "--planner-profile" not in deployment_parts(same)[-1].launch.argv


def test_scale_steps_stay_within_the_bounds():
    assert [scale_steps(d, 1, (1, 3)) for d in (0, 1, 2, 5)] == [0, 0, 1, 2]
    assert [scale_steps(d, 3, (1, 3)) for d in (1, 2, 3)] == [-2, -1, 0]


def test_a_failed_scale_step_is_tried_again_after_a_bounded_backoff_reset_once_one_serves():
    backoff = RetryBackoff(initial_s=10, max_s=60)
    assert backoff.due(0.0)
    assert [backoff.failed(t) for t in (0.0, 10.0, 30.0, 70.0, 130.0)] == [10, 20, 40, 60, 60]
    assert not backoff.due(189.0) and backoff.due(190.0)
    backoff.served()
    assert backoff.failed(200.0) == 10 and backoff.due(210.0)
    with pytest.raises(ValueError):
        RetryBackoff(initial_s=0)
