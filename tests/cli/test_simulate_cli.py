from __future__ import annotations

import json

import pytest

from pdkv.cli import run

from support.planner_profiles import write_profile


def test_simulate_json_compares_the_planner_with_a_static_fleet(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json", capacity=100_000)
    args = ["simulate", "--profile", str(profile), "--slo", "ttft=400,itl=40", "--peak-rate", "10", "--prompt-tokens", "500-1500",
            "--output-tokens", "50", "--day-seconds", "600", "--startup-s", "20", "--down-after-s", "30", "--json"]  # fmt: skip
    assert run(args) == 0
    data = json.loads(capsys.readouterr().out)
    planner, static = data["planner"], data["static"]
    assert planner["requests"] == static["requests"] > 0
    assert data["goal"] == planner["attainment"] and static["attainment"] >= data["goal"]
    assert planner["timeline"] and all(p["prefill"] >= 1 and p["decode"] >= 1 for p in planner["timeline"])
    # Engines run until the day's last request is answered, a little past the day.
    assert static["engine_hours"] == pytest.approx((data["static_prefill"] + data["static_decode"]) * 600 / 3600, rel=0.01)


def test_simulate_table(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json")
    assert run(["simulate", "--profile", str(profile), "--slo", "ttft=400,itl=40", "--peak-rate", "5", "--output-tokens", "20",
                "--day-seconds", "300"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "best static" in out and "engine-hours" in out


def test_simulate_refuses_a_day_too_big_and_bad_words(tmp_path, capsys):
    profile = write_profile(tmp_path / "p.json")
    base = ["simulate", "--profile", str(profile), "--slo", "ttft=400,itl=40"]
    assert run([*base, "--peak-rate", "1000", "--day-seconds", "86400"]) == 2
    assert "--max-requests" in capsys.readouterr().err
    assert run([*base, "--peak-rate", "5", "--levels", "a,b"]) == 2
    assert run([*base, "--peak-rate", "5", "--prefill-range", "3..2"]) == 2
    assert run([*base, "--peak-rate", "5", "--goal", "1.5"]) == 2
