from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdkv.cli import run


def test_plan_json_gives_the_seed_figures(qwen3_8b, capsys):
    code = run(["plan", "--model", str(qwen3_8b), "--prompt-tokens", "1000", "--output-tokens", "128", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["bytes_per_token"] == 147456
    assert data["bytes_per_block"] == 2359296
    assert data["blocks"] == 63
    assert data["transfer_bytes"] == 148635648
    assert round(data["floor_ms"]) == 3
    assert data["decode_blocks"] == 71


def test_plan_table_for_explicit_geometry(capsys):
    code = run(["plan", "--layers", "36", "--kv-heads", "8", "--head-dim", "128", "--prompt-tokens", "1000"])
    out = capsys.readouterr().out
    assert code == 0
    assert "148,635,648" in out and "2.97 ms" in out


def test_missing_file_is_one_line_and_exit_2(tmp_path, capsys):
    code = run(["plan", "--model", str(tmp_path / "nope")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pdkv: error: no model config")
    assert "Traceback" not in err


def test_malformed_json_and_missing_geometry(tmp_path, capsys):
    (tmp_path / "config.json").write_text("[1, 2")
    assert run(["plan", "--model", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert run(["plan", "--layers", "36"]) == 2
    assert "no model geometry" in capsys.readouterr().err


def test_unsupported_architecture_says_what(fixtures, capsys):
    assert run(["plan", "--model", str(fixtures / "configs" / "jamba.json")]) == 2
    assert "Mamba" in capsys.readouterr().err


def test_bad_flag_is_usage_error(capsys):
    assert run(["plan", "--no-such-flag"]) == 2


def test_version(capsys):
    assert run(["--version"]) == 0
    assert capsys.readouterr().out.startswith("pdkv ")


def test_help_imports_nothing_heavy():
    code = (
        "import sys; from pdkv.cli import run; run(['--help']);"
        "heavy = [m for m in ('vllm', 'torch', 'mooncake', 'zmq', 'numpy') if m in sys.modules];"
        "print('HEAVY', heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out


def test_plan_for_p_and_d_of_different_tp_gives_each_ranks_bytes(qwen3_8b, capsys):
    code = run(["plan", "--model", str(qwen3_8b), "--prompt-tokens", "1000", "--tp", "1:2", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert [(r["p_rank"], r["d_rank"], r["heads"]) for r in data["ranks"]] == [(0, 0, 4), (0, 1, 4)]
    assert sum(r["bytes"] for r in data["ranks"]) == data["transfer_bytes"] == 148635648
    assert {r["descriptors"] for r in data["ranks"]} == {36 * 63}  # half of each block: one per layer and block
    assert run(["plan", "--model", str(qwen3_8b), "--tp", "4:2"]) == 0
    out = capsys.readouterr().out
    assert "P TP 4 -> D TP 2" in out and "per rank" in out and "148,635,648" in out


def test_plan_refuses_tp_sizes_that_do_not_divide(qwen3_8b, capsys):
    assert run(["plan", "--model", str(qwen3_8b), "--tp", "2:3"]) == 2
    assert "do not divide each other" in capsys.readouterr().err
    assert run(["plan", "--model", str(qwen3_8b), "--tp", "two"]) == 2
    assert "P:D pair" in capsys.readouterr().err


def _profile_file(tmp_path, **kw):
    from support.planner_profiles import write_profile

    return write_profile(tmp_path / "p.profile.json", **kw)


def test_slo_plan_json_names_counts_predictions_and_the_binding_target(tmp_path, capsys):
    from pdkv.planner.capacity import predict
    from pdkv.planner.profile import load_profile
    from pdkv.planner.workload import Workload, parse_lengths

    path = _profile_file(tmp_path, capacity=200_000)
    args = ["plan", "--profile", str(path), "--slo", "ttft=400,itl=40", "--rate", "20", "--prompt-tokens", "200-2000",
            "--output-tokens", "128", "--json"]  # fmt: skip
    assert run(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["feasible"] is True and data["binding"] in ("ttft", "itl")
    p, d = data["prefill_engines"], data["decode_engines"]
    assert p >= 1 and d >= 1
    w = Workload(20.0, parse_lengths("200-2000", "x"), [128])
    again = predict(load_profile(path), w, p, d, 0.9)
    assert data["prediction"]["ttft_ms"] == pytest.approx(again.ttft_ms) and again.ttft_ms <= 400
    assert data["prediction"]["itl_ms"] == pytest.approx(again.itl_ms) and again.itl_ms <= 40


def test_slo_plan_table_and_an_unmeetable_target_exits_1(tmp_path, capsys):
    path = _profile_file(tmp_path)
    assert run(["plan", "--profile", str(path), "--slo", "ttft=400,itl=40", "--rate", "5", "--output-tokens", "64"]) == 0
    out = capsys.readouterr().out
    assert "prefill (P)" in out and "binding:" in out
    assert run(["plan", "--profile", str(path), "--slo", "ttft=50,itl=40", "--rate", "5", "--prompt-tokens", "4000",
                "--output-tokens", "64"]) == 1  # fmt: skip
    assert "no plan" in capsys.readouterr().out


def test_slo_plan_usage_errors(tmp_path, capsys):
    path = _profile_file(tmp_path)
    assert run(["plan", "--slo", "ttft=400,itl=40", "--rate", "5"]) == 2
    assert "--profile" in capsys.readouterr().err
    assert run(["plan", "--profile", str(path), "--rate", "5"]) == 2
    assert "needs --slo" in capsys.readouterr().err
    assert run(["plan", "--profile", str(path), "--slo", "ttft=400", "--rate", "5", "--output-tokens", "8"]) == 2
    assert run(["plan", "--prompt-tokens", "100-200", "--layers", "36", "--kv-heads", "8", "--head-dim", "128"]) == 2
    assert "one token count" in capsys.readouterr().err


def test_profile_of_an_engine_that_is_not_there_is_one_line(capsys):
    code = run(["profile", "--prefill", "http://127.0.0.1:9", "--timeout", "2"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("pdkv: error: http://127.0.0.1:9/v1/models") and "Traceback" not in err
