"""`pdkv k8s render`: the golden manifests of the examples, kubectl kustomize, --json, bad input exits 2 writing nothing.

PDKV_UPDATE_GOLDEN=1 writes the golden files (tests/fixtures/k8s/<example>/) anew instead of comparing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pdkv.cli import run

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "fixtures" / "k8s"
EXAMPLES = ("k8s-1p1d", "k8s-4p2d", "k8s-autoscale")
from support.k8s_objects import K8S_VERSIONS, validate
from support.ports import free_port


def render_into(tmp_path: Path, example: str, capsys, *extra: str) -> Path:
    out = tmp_path / example
    code = run(["k8s", "render", "-f", str(ROOT / "examples" / f"{example}.toml"), "-o", str(out), *extra])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert f"kubectl apply -k {out}" in captured.out
    return out


@pytest.mark.parametrize("example", EXAMPLES)
def test_rendering_the_examples_gives_the_golden_files(tmp_path: Path, example: str, capsys):
    out = render_into(tmp_path, example, capsys)
    golden = GOLDEN / example
    if os.environ.get("PDKV_UPDATE_GOLDEN") == "1":
        shutil.rmtree(golden, ignore_errors=True)
        shutil.copytree(out, golden)
    produced = {p.name: p.read_text() for p in sorted(out.iterdir())}
    expected = {p.name: p.read_text() for p in sorted(golden.iterdir())}
    assert sorted(produced) == sorted(expected), "files differ: PDKV_UPDATE_GOLDEN=1 rewrites the golden files"
    for name, text in produced.items():
        assert text == expected[name], f"{example}/{name} differs from the golden file (PDKV_UPDATE_GOLDEN=1 rewrites it)"
    listed = yaml.safe_load(produced["kustomization.yaml"])["resources"]
    assert sorted(listed) == sorted(n for n in produced if n != "kustomization.yaml")


@pytest.mark.parametrize("example", EXAMPLES)
def test_the_golden_files_validate(example: str):
    for path in sorted((GOLDEN / example).glob("*.yaml")):
        if path.name != "kustomization.yaml":
            for version in (K8S_VERSIONS[0], K8S_VERSIONS[-1]):
                validate(yaml.safe_load(path.read_text()), version)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed (scripts/setup.sh installs it)")
@pytest.mark.parametrize("example", EXAMPLES)
def test_kubectl_kustomize_accepts_the_folder(tmp_path: Path, example: str, capsys):
    out = render_into(tmp_path, example, capsys)
    proc = subprocess.run(["kubectl", "kustomize", str(out)], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    built = {(o["kind"], o["metadata"]["name"]): o for o in yaml.safe_load_all(proc.stdout)}
    ours = [yaml.safe_load(p.read_text()) for p in out.glob("*.yaml") if p.name != "kustomization.yaml"]
    assert built == {(o["kind"], o["metadata"]["name"]): o for o in ours}


def test_stdout_stream_and_json_hold_the_same_objects(capsys):
    example = str(ROOT / "examples" / "k8s-4p2d.toml")
    assert run(["k8s", "render", "-f", example]) == 0
    stream = [o for o in yaml.safe_load_all(capsys.readouterr().out) if o]
    assert run(["k8s", "render", "-f", example, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["files"] == [] and doc["objects"] == stream
    assert [o["kind"] for o in stream].count("LeaderWorkerSet") == 2


def test_namespace_flag_and_json_with_files(tmp_path: Path, capsys):
    out = tmp_path / "m"
    assert run(["k8s", "render", "-f", str(ROOT / "examples" / "k8s-1p1d.toml"), "-o", str(out), "--namespace", "serving", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {o["metadata"]["namespace"] for o in doc["objects"]} == {"serving"}
    assert sorted(Path(f).name for f in doc["files"]) == sorted(p.name for p in out.iterdir())


def test_a_second_rendering_removes_the_files_it_no_longer_lists(tmp_path: Path, capsys):
    src = tmp_path / "d.toml"
    one_decode = 'model = "m"\n[[prefill]]\nport = 8010\n[[decode]]\nport = 8020\n'
    src.write_text(one_decode + "[[decode]]\nport = 8021\n")
    out = tmp_path / "m"
    assert run(["k8s", "render", "-f", str(src), "-o", str(out)]) == 0
    assert (out / "deployment-pdkv-decode-1.yaml").exists()
    (out / "notes.txt").write_text("mine")
    src.write_text(one_decode)
    assert run(["k8s", "render", "-f", str(src), "-o", str(out)]) == 0
    capsys.readouterr()
    assert not (out / "deployment-pdkv-decode-1.yaml").exists() and (out / "deployment-pdkv-decode-0.yaml").exists()
    assert (out / "notes.txt").read_text() == "mine"
    assert "decode-1" not in (out / "kustomization.yaml").read_text()


BAD = {
    "unknown key": ('[kubernetes]\nimage = "x"\ngpu_per_node = 4\n', "gpu_per_node"),
    "tp": ("[kubernetes]\ngpus_per_node = 4\n", "tp = 3, which does not divide gpus_per_node = 4"),
    "resource name": ('[kubernetes]\nrdma_resource = "RDMA/ib!"\n', "is not a Kubernetes resource name"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path: Path, case: str, capsys):
    table, words = BAD[case]
    src = tmp_path / "bad.toml"
    src.write_text(f'model = "m"\n[[prefill]]\nport = 8010\ntp = {3 if case == "tp" else 1}\n[[decode]]\nport = 8020\n{table}')
    out = tmp_path / "out"
    assert run(["k8s", "render", "-f", str(src), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert lines[0].startswith("pdkv: error: ") and words in lines[0], captured.err
    assert len(lines) <= 2 and all(line.startswith("  hint: ") for line in lines[1:])
    assert captured.out == "" and not out.exists()


def test_json_gives_the_prometheus_adapter_rule_where_an_hpa_needs_it(tmp_path: Path, capsys):
    from pdkv.k8s import adapter_rules

    example = ROOT / "examples" / "k8s-autoscale.toml"
    assert run(["k8s", "render", "-f", str(example), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prometheus_adapter"] == adapter_rules()
    assert [o["kind"] for o in doc["objects"]][-2:] == ["HorizontalPodAutoscaler"] * 2
    keda = tmp_path / "keda.toml"
    keda.write_text(example.read_text().replace('kubernetes = "hpa"', 'kubernetes = "keda"'))
    assert run(["k8s", "render", "-f", str(keda), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["prometheus_adapter"] is None and [o["kind"] for o in doc["objects"]][-2:] == ["ScaledObject"] * 2
    assert run(["k8s", "render", "-f", str(ROOT / "examples" / "k8s-1p1d.toml"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prometheus_adapter"] is None


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (('kubernetes = "hpa"', 'kubernetes = "vpa"'), "Invalid enum value 'vpa'"),
        (("min = 2\nmax = 16", "min = 4\nmax = 3"), "[autoscale.decode] needs 1 <= min <= max"),
        (("[proxy]", "[[decode]]\nport = 8021\n[proxy]"), "[autoscale.decode] scales one workload, and the file has 2 [[decode]] tables"),
    ],
)
def test_bad_autoscale_settings_exit_2_writing_nothing(tmp_path: Path, change: tuple[str, str], words: str, capsys):
    text = (ROOT / "examples" / "k8s-autoscale.toml").read_text()
    assert change[0] in text
    src = tmp_path / "bad.toml"
    src.write_text(text.replace(change[0], change[1]))
    out = tmp_path / "out"
    assert run(["k8s", "render", "-f", str(src), "-o", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("pdkv: error: ") and words in captured.err.splitlines()[0], captured.err
    assert captured.out == "" and not out.exists()


def test_pdkv_up_accepts_the_kubernetes_table_and_refuses_unknown_keys_in_it(tmp_path: Path, capsys):
    assert run(["up", "--dry-run", "--json", "-f", str(ROOT / "examples" / "k8s-1p1d.toml")]) == 0
    names = [p["name"] for p in json.loads(capsys.readouterr().out)["parts"]]
    assert names == ["bootstrap-0", "prefill-0", "decode-0", "proxy"]
    src = tmp_path / "bad.toml"
    src.write_text('model = "m"\n[[prefill]]\nport = 8010\n[[decode]]\nport = 8020\n[kubernetes]\nnamespce = "x"\n')
    assert run(["up", "--dry-run", "-f", str(src)]) == 2
    assert "namespce" in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs sh")
@pytest.mark.skipif(bool(os.path.isdir("/sys/class/infiniband") and os.listdir("/sys/class/infiniband")),
                    reason="this machine has an RDMA NIC: the doctor would pass")
def test_the_doctor_init_container_fails_a_node_without_rdma_with_one_line(tmp_path: Path):
    # This machine has no RDMA NIC: the init container's own command exits 4 with the reason in its termination log.
    deployment = yaml.safe_load((GOLDEN / "k8s-1p1d" / "deployment-qwen3-8b-prefill-0.yaml").read_text())
    (init,) = deployment["spec"]["template"]["spec"]["initContainers"]
    sh, flag, script = init["command"]
    log = tmp_path / "termination-log"
    assert script.startswith("exec pdkv doctor ") and script.endswith(" 2>/dev/termination-log")
    script = script.replace("exec pdkv ", f"exec {sys.executable} -m pdkv ").replace("/dev/termination-log", str(log))
    script = re.sub(r"--port \d+", lambda m: f"--port {free_port()}", script)  # the pod's ports may be taken on this machine
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "120"}
    env.pop("PDKV_SYS_ROOT", None)
    proc = subprocess.run([sh, flag, script], env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 4, proc.stdout[-2000:] + log.read_text()
    first, *rest = log.read_text().splitlines()
    assert first.startswith("pdkv: error: ") and "rdma_devices: no RDMA devices under /sys/class/infiniband" in first
    assert [line for line in rest if not line.startswith("  hint: ")] == []
    assert "rdma_devices" in proc.stdout  # the table stays in the container's log


def test_help_shows_the_tables_and_examples(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    assert run(["k8s", "render", "--help"]) == 0
    out = capsys.readouterr().out
    assert "[[prefill]] and [[decode]] table" in out and "[kubernetes] table" in out
    assert "pdkv k8s render -f examples/k8s-1p1d.toml -o k8s/" in out
