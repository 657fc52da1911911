from __future__ import annotations

import csv
import json
import threading

import pytest

from pdkv.cli import run

pytest.importorskip("mooncake")

TINY = ["--layers", "2", "--kv-heads", "2", "--head-dim", "32"]
QUICK = ["--iters", "3", "--warmup", "1"]


def test_help_has_examples(capsys):
    for argv in (["bench", "--help"], ["bench", "serve", "--help"], ["bench", "run", "--help"]):
        assert run(argv) == 0
        assert "Examples:" in capsys.readouterr().out


def test_json_report_matches_plan(capsys):
    assert run(["plan", *TINY, "--prompt-tokens", "64", "--json"]) == 0
    plan_bytes = json.loads(capsys.readouterr().out)["transfer_bytes"]
    assert run(["bench", *TINY, *QUICK, "--blocks", "4", "--layout", "all", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(c["layout"], c["descriptors"]) for c in report["cases"]] == [("contiguous", 2), ("per-block", 8), ("scattered", 8)]
    assert all(c["bytes"] == plan_bytes and c["verified"] for c in report["cases"])
    assert report["link_gbps"] == 400.0 and report["link_source"] == "default"


def test_sweep_table_and_csv(capsys, tmp_path):
    out = tmp_path / "bench.csv"
    argv = ["bench", *TINY, *QUICK, "--sweep", "blocks=1,3", "--layout", "per-block", "--link-gbps", "100", "--csv", str(out)]
    assert run(argv) == 0
    text = capsys.readouterr().out
    assert "what moves" in text and "rate (link 100 Gb/s)" in text
    rows = list(csv.DictReader(out.read_text().splitlines()))
    assert [(r["layout"], r["blocks"], r["descriptors"]) for r in rows] == [("per-block", "1", "2"), ("per-block", "3", "6")]
    assert all(r["bytes"] == r["plan_bytes"] and r["verified"] == "True" for r in rows)


def test_run_against_serve(capsys):
    from pdkv.bench.control import BenchTarget
    from pdkv.bench.runner import settings_from_env

    with BenchTarget("127.0.0.1", 0, settings=settings_from_env()) as target:
        stop = threading.Event()
        thread = threading.Thread(target=target.serve, kwargs={"stop": stop}, daemon=True)
        thread.start()
        try:
            assert run(["bench", "run", "--target", target.address, *TINY, *QUICK, "--blocks", "2", "--json"]) == 0
        finally:
            stop.set()
            thread.join(5)
    report = json.loads(capsys.readouterr().out)
    assert report["target"] == target.address and report["cases"][0]["verified"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--sweep", "iters=1,2"], "cannot vary"),
        (["--layout", "diagonal"], "unknown layout"),
        (["--target", "nohost"], "HOST:PORT"),
        (["--mc", "MC_LOG_LEVEL"], "MC_NAME=VALUE"),
        (["--iters", "0"], "--iters"),
        (["--src", "gpu0"], "unknown memory device"),
    ],
)
def test_usage_errors_exit_2(capsys, argv, message):
    assert run(["bench", *TINY, *argv]) == 2
    assert message in capsys.readouterr().err


def test_no_geometry_is_a_usage_error(capsys):
    assert run(["bench"]) == 2
    assert "geometry" in capsys.readouterr().err


def test_cma_between_two_processes_verified_beside_memmove(capsys):
    assert run(["bench", *TINY, *QUICK, "--transport", "cma", "--blocks", "4", "--layout", "all", "--baseline", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["transport"] == "cma" and (report["src"], report["dst"]) == ("cpu", "cpu")
    assert report["peer"].startswith("cma:")
    for c in report["cases"]:
        assert c["verified"] and c["baseline"]["bare"]["p50_ms"] > 0
        assert "memmove" in c["baseline"]["teb_note"]


def test_cma_moves_host_memory_only(capsys):
    assert run(["bench", *TINY, "--transport", "cma", "--src", "cuda:0"]) == 2
    assert "host memory" in capsys.readouterr().err
