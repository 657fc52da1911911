"""The shipped monitoring files (monitoring/): promtool accepts them, and every metric they name is one that pdkv
or vLLM exports, of the type its use needs. tests/e2e/test_operator.py runs them against a live deployment."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

MONITORING = Path(__file__).resolve().parents[2] / "monitoring"
NAME = re.compile(r"\b((?:pdkv_|vllm:)[a-z_:]+)")
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None, reason="needs Debian's prometheus package (scripts/setup.sh)")


def _exprs() -> list[str]:
    dash = json.loads((MONITORING / "grafana" / "pdkv-dashboard.json").read_text())
    groups = yaml.safe_load((MONITORING / "pdkv-rules.yml").read_text())["groups"]
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])] + [r["expr"] for g in groups for r in g["rules"]]


def _pdkv_families() -> dict[str, str]:
    """Every metric family pdkv exports, by name, with its type."""
    from pdkv.bootstrap.members import MemberTable
    from pdkv.bootstrap.registry import BootstrapRegistry
    from pdkv.bootstrap.server import BootstrapMetrics
    from pdkv.connector.timing import TraceLog
    from pdkv.planner.gauges import PlannerGauges
    from pdkv.proxy.kv.metrics import KvMetrics
    from pdkv.proxy.metrics import ProxyMetrics

    proxy, planner = ProxyMetrics(), CollectorRegistry()
    KvMetrics(proxy.registry)
    PlannerGauges(planner)
    registries = [proxy.registry, planner, TraceLog("prefill").registry, BootstrapMetrics(BootstrapRegistry(), MemberTable()).registry]
    return {m.name: m.type for r in registries for m in r.collect()}


def _used() -> set[str]:
    """Metric names the rules and panels read (recording rules' own names, `pdkv:...`, left out)."""
    return {m for e in _exprs() for m in NAME.findall(e)}


@needs_promtool
def test_promtool_checks_the_rules_and_the_scrape_configuration() -> None:
    for args in (["check", "rules", "pdkv-rules.yml"], ["check", "config", "prometheus.yml"]):
        done = subprocess.run(["promtool", *args], cwd=MONITORING, capture_output=True, text=True, timeout=60, check=False)
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_pdkv_metric_named_exists_with_the_type_its_use_needs() -> None:
    families = _pdkv_families()
    for name in sorted(n for n in _used() if n.startswith("pdkv_")):
        if name.endswith("_bucket"):
            assert families.get(name.removesuffix("_bucket")) == "histogram", name
        elif name.endswith("_total"):
            assert families.get(name.removesuffix("_total")) == "counter", name
        else:
            assert families.get(name) == "gauge", name


def test_every_vllm_metric_named_is_one_vllm_exports() -> None:
    loggers = Path(pytest.importorskip("vllm").__file__).parent / "v1" / "metrics" / "loggers.py"
    source = loggers.read_text()
    for name in sorted(n for n in _used() if n.startswith("vllm:")):
        base = re.sub(r"_(bucket|total)$", "", name)
        assert f'"{base}"' in source or f'"{base}_total"' in source, name


def test_counters_are_read_through_rate_and_histograms_through_quantiles() -> None:
    for expr in _exprs():
        for name in NAME.findall(expr):
            if name.endswith("_total"):
                assert re.search(rf"(rate|increase)\({re.escape(name)}\b", expr), f"{name} read raw in {expr}"
            if name.endswith("_bucket"):
                assert "histogram_quantile" in expr, f"{name} outside a quantile in {expr}"


def test_the_dashboard_uses_the_datasource_variable_and_unique_panel_ids() -> None:
    dash = json.loads((MONITORING / "grafana" / "pdkv-dashboard.json").read_text())
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
