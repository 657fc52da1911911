"""`pdkv.k8s.autoscale`: an autoscaler per role on the planner's gauge, valid, aimed at the role's workload, and
asking for the count the gauge holds; bad `[autoscale]` settings are one ConfigError."""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.k8s_objects import EXAMPLES, K8S_VERSIONS, deployment_text, lws_crd_version, render_file, render_text, validate

from pdkv.deploy.plan.loader import load_deployment
from pdkv.errors import ConfigError
from pdkv.k8s import adapter_rules, render
from pdkv.k8s.autoscale import METRIC, query
from pdkv.planner import Desired, PlannerGauges

EXAMPLE = EXAMPLES / "k8s-autoscale.toml"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "k8s.md"

KUBERNETES = """name = "q"
namespace = "serving"
gpus_per_node = 4
[autoscale]
profile = "p.profile.json"
ttft_ms = 500
itl_ms = 40
{autoscale}
[autoscale.prefill]
min = 1
max = 4
[autoscale.decode]
min = 2
max = 6"""


def text(prefill: str = "", decode: str = "replicas = 2", autoscale: str = "") -> str:
    return deployment_text(prefill=prefill, decode=decode, kubernetes=KUBERNETES.format(autoscale=autoscale))


VARIANTS = {
    "hpa-deployments": text(),
    "hpa-lws": text(prefill="tp = 8", decode="tp = 8\nreplicas = 2"),
    "keda-deployments": text(autoscale='kubernetes = "keda"\nprometheus_url = "https://prom.example:9090"'),
    "keda-lws": text(prefill="tp = 8", decode="tp = 4\nreplicas = 3", autoscale='kubernetes = "keda"'),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request, tmp_path_factory) -> list[dict]:
    return render_text(tmp_path_factory.mktemp(request.param), VARIANTS[request.param])


def _autoscalers(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ("HorizontalPodAutoscaler", "ScaledObject")]


def _by_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_keda_and_lws_schemas(rendered, version):
    assert len(_autoscalers(rendered)) == 2
    for obj in rendered:
        validate(obj, version)


def test_the_validation_refuses_a_misspelled_field_or_trigger_key(tmp_path: Path):
    for sub in ("h", "k"):
        (tmp_path / sub).mkdir()
    hpa = _autoscalers(render_text(tmp_path / "h", VARIANTS["hpa-deployments"]))[0]
    bad = copy.deepcopy(hpa)
    bad["spec"]["behavior"]["scaleDown"]["stabilisationWindowSeconds"] = 0
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad, "1.30")
    so = _autoscalers(render_text(tmp_path / "k", VARIANTS["keda-deployments"]))[0]
    for path, key in ((("spec",), "minReplicas"), (("spec", "triggers", 0, "metadata"), "serveraddress")):
        bad = copy.deepcopy(so)
        node = bad
        for step in path:
            node = node[step]
        node[key] = "1"
        with pytest.raises(jsonschema.ValidationError):
            validate(bad, "1.30")
    bad = copy.deepcopy(so)  # the behavior KEDA hands its HPA goes through the HPA schema too
    bad["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]["policies"][0]["periodSecs"] = 15
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad, "1.37")


def test_each_role_gets_one_autoscaler_on_its_own_workload_which_has_a_scale_subresource(rendered):
    objects = _by_name(rendered)
    scale = lws_crd_version()["subresources"]["scale"]
    roles = []
    for auto in _autoscalers(rendered):
        ref = auto["spec"]["scaleTargetRef"]
        workload = objects[(ref["kind"], ref["name"])]
        assert ref["apiVersion"] == workload["apiVersion"] and auto["metadata"]["namespace"] == workload["metadata"]["namespace"]
        role = workload["metadata"]["labels"]["pdkv/role"]
        roles.append(role)
        assert auto["metadata"]["labels"]["pdkv/role"] == role
        if ref["kind"] == "LeaderWorkerSet":  # the HPA scales groups, one engine each, through the CRD's scale subresource
            assert ref["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and scale["specReplicasPath"] == ".spec.replicas"
            assert scale["labelSelectorPath"] == ".status.hpaPodSelector"
        else:
            assert (ref["apiVersion"], ref["kind"]) == ("apps/v1", "Deployment")
        # The autoscaler owns the count: a manifest naming replicas would set it back at every kubectl apply.
        assert "replicas" not in workload["spec"]
    assert sorted(roles) == ["decode", "prefill"]


def test_bounds_and_metric_follow_the_file(rendered):
    bounds = {"prefill": (1, 4), "decode": (2, 6)}
    for auto in _autoscalers(rendered):
        role = auto["metadata"]["labels"]["pdkv/role"]
        spec = auto["spec"]
        if auto["kind"] == "HorizontalPodAutoscaler":
            assert (spec["minReplicas"], spec["maxReplicas"]) == bounds[role]
            (metric,) = spec["metrics"]
            assert metric["type"] == "External"
            assert metric["external"]["metric"] == {"name": METRIC, "selector": {"matchLabels": {"role": role}}}
            assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
            behavior = spec["behavior"]
        else:
            assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == bounds[role]
            (trigger,) = spec["triggers"]
            assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
            meta = trigger["metadata"]
            assert meta["query"] == f'max({METRIC}{{namespace="serving",role="{role}"}})' and meta["threshold"] == "1"
            assert meta["ignoreNullValues"] == "false"  # an unscraped proxy is an error, not a desired count of 0
            assert meta["serverAddress"] in ("https://prom.example:9090", "http://prometheus-operated.monitoring.svc:9090")
            behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        for direction in ("scaleUp", "scaleDown"):  # the gauge holds the planner's hysteresis: no second window on top
            assert behavior[direction]["stabilizationWindowSeconds"] == 0
            assert behavior[direction]["policies"] == [{"type": "Pods", "value": bounds[role][1], "periodSeconds": 15}]


def test_the_api_servers_own_rules_hold_where_the_schema_says_nothing(rendered):
    """What Kubernetes' HPA validation (pkg/apis/autoscaling/validation) checks beyond the OpenAPI schema."""
    for auto in _autoscalers(rendered):
        spec = auto["spec"]
        if auto["kind"] == "HorizontalPodAutoscaler":
            lo, hi, behavior = spec["minReplicas"], spec["maxReplicas"], spec["behavior"]
            assert float(spec["metrics"][0]["external"]["target"]["averageValue"]) > 0
        else:
            lo, hi = spec["minReplicaCount"], spec["maxReplicaCount"]
            behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        assert 1 <= lo <= hi  # minReplicas 0 needs the HPAScaleToZero gate
        for rules in behavior.values():
            assert 0 <= rules["stabilizationWindowSeconds"] <= 3600 and rules["selectPolicy"] in ("Max", "Min", "Disabled")
            assert rules["policies"] and all(0 < p["periodSeconds"] <= 1800 and p["value"] > 0 for p in rules["policies"])


def _hpa_model(auto: dict, series: list[float], current: int, tolerance: float = 0.1) -> int:
    """A MODEL of the HPA controller's arithmetic (no cluster here): kube-controller-manager's replica calculator for an
    External AverageValue metric (the sum of the series over the target, unchanged within the tolerance), the
    stabilization window (0: the recommendation as it is), the policies' step per period, then min and max."""
    spec = auto["spec"]
    if auto["kind"] == "ScaledObject":  # KEDA creates this HPA: its trigger's threshold as an AverageValue target
        lo, hi, target = spec["minReplicaCount"], spec["maxReplicaCount"], float(spec["triggers"][0]["metadata"]["threshold"])
        behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    else:
        lo, hi, target = spec["minReplicas"], spec["maxReplicas"], float(spec["metrics"][0]["external"]["target"]["averageValue"])
        behavior = spec["behavior"]
    usage = sum(series)
    want = current if abs(usage / (target * current) - 1) <= tolerance else math.ceil(usage / target)
    rules = behavior["scaleUp" if want > current else "scaleDown"]
    assert rules["stabilizationWindowSeconds"] == 0
    step = max(p["value"] if p["type"] == "Pods" else math.ceil(current * p["value"] / 100) for p in rules["policies"])
    want = min(want, current + step) if want > current else max(want, current - step)
    return min(hi, max(lo, want))


def test_replicas_track_the_desired_count_in_one_period(rendered):
    for auto in _autoscalers(rendered):
        lo, hi = (1, 4) if auto["metadata"]["labels"]["pdkv/role"] == "prefill" else (2, 6)
        for current in range(lo, hi + 1):
            for desired in range(lo, hi + 1):
                got = _hpa_model(auto, [float(desired)], current)  # the one series the query's max leaves
                if abs(desired / current - 1) > 0.1:
                    assert got == desired, (auto["metadata"]["name"], current, desired)
                else:  # the HPA's tolerance (10% by default): at these bounds only desired == current
                    assert got == current == desired
        assert _hpa_model(auto, [float(hi + 5)], lo) == hi and _hpa_model(auto, [1.0], hi) == lo


def test_the_query_and_the_adapter_rule_select_the_gauge_the_planner_exports():
    registry = CollectorRegistry()
    PlannerGauges(registry).publish(Desired(3, 5, "ttft", 3, 5, 2, 4, 400.0, 30.0), current_prefill=2, current_decode=5)
    families = text_string_to_metric_families(generate_latest(registry).decode())
    exported = [s for f in families for s in f.samples if s.name == METRIC]
    assert sorted(s.labels["role"] for s in exported) == ["decode", "prefill"]

    # Prometheus scrapes two proxy pods (a FAKE of its target labels) in two namespaces; PromQL is evaluated below
    # for the one form the autoscalers use: max(metric{label="value",...}).
    scraped = [({**s.labels, "namespace": ns, "pod": pod}, s.value + (ns == "other")) for s in exported
               for ns in ("serving", "other") for pod in ("proxy-a", "proxy-b")]

    def evaluate(promql: str) -> float:
        m = re.fullmatch(r"max\((\w+)\{(.*)\}\)", promql)
        assert m and m[1] == METRIC, promql
        want = dict(re.findall(r'(\w+)="([^"]*)"', m[2]))
        return max(v for labels, v in scraped if want.items() <= labels.items())

    assert evaluate(query("prefill", "serving")) == 3 and evaluate(query("decode", "serving")) == 5
    (rule,) = adapter_rules()["externalRules"]
    series = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"])
    assert series and series[1] == METRIC and set(re.findall(r'(\w+)!=""', series[2])) == {"namespace", "role"}
    assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}}}  # the adapter adds the HPA's namespace
    assert rule["name"]["as"] == METRIC and re.fullmatch(rule["name"]["matches"], METRIC)
    # The adapter fills the template with the metric and the HPA's selector plus its namespace (its docs/config.md).
    filled = rule["metricsQuery"].replace("<<.Series>>", METRIC).replace("<<.LabelMatchers>>", 'role="decode",namespace="serving"')
    assert evaluate(filled) == 5


def test_the_docs_show_the_adapter_rule_the_code_gives():
    blocks = re.findall(r"```yaml\n(.*?)```", DOCS.read_text(), flags=re.DOTALL)
    assert adapter_rules() in [yaml.safe_load(b) for b in blocks]


def test_without_autoscale_nothing_changes_and_the_example_renders_hpas():
    objects = render_file(EXAMPLES / "k8s-1p1d.toml")
    assert not _autoscalers(objects)
    assert all(o["spec"]["replicas"] == 1 for o in objects if o["kind"] == "Deployment" and "-prefill-" in o["metadata"]["name"])
    example = render_file(EXAMPLE)
    assert [(o["kind"], o["spec"]["minReplicas"], o["spec"]["maxReplicas"]) for o in _autoscalers(example)] == [
        ("HorizontalPodAutoscaler", 1, 8), ("HorizontalPodAutoscaler", 2, 16)]


def _code_built(tmp_path: Path, **autoscale) -> list[dict]:
    """What a program could hand `render` without the loader's checks."""
    path = tmp_path / "deploy.toml"
    path.write_text(text())
    dep = load_deployment(path)
    dep = msgspec.structs.replace(dep, autoscale=msgspec.structs.replace(dep.autoscale, **autoscale))
    return render(dep, source="deploy.toml")


@pytest.mark.parametrize(
    ("file_text", "words"),
    [
        (text(autoscale='kubernetes = "vpa"'), "Invalid enum value 'vpa'"),
        (text(decode="replicas = 1"), "1 decode engines ([[decode]] tables x replicas) lie outside [autoscale.decode]'s 2..6"),
        (text().replace("min = 2\nmax = 6", "min = 7\nmax = 6"), "[autoscale.decode] needs 1 <= min <= max, got min = 7, max = 6"),
        (text() + "[[prefill]]\nport = 8011\n", "[autoscale.prefill] scales one workload, and the file has 2 [[prefill]] tables"),
        (text(autoscale='kubernetes = "keda"\nprometheus_url = "prometheus:9090"'),
         "prometheus_url = 'prometheus:9090' is not an http(s) URL"),
    ],
)
def test_bad_settings_are_one_config_error(tmp_path: Path, file_text: str, words: str):
    with pytest.raises(ConfigError) as err:
        render_text(tmp_path, file_text)
    assert words in err.value.message and "\n" not in err.value.message


def test_bad_settings_built_in_code_are_refused_by_render_too(tmp_path: Path):
    from pdkv.deploy.plan.schema import RoleBounds

    cases = [
        ({"kubernetes": "vpa"}, "[autoscale] kubernetes = 'vpa' is not an autoscaler pdkv renders"),
        ({"prefill": RoleBounds(min=3, max=2)}, "[autoscale.prefill] needs 1 <= min <= max, got min = 3, max = 2"),
        ({"decode": RoleBounds(min=0, max=2)}, "[autoscale.decode] needs 1 <= min <= max"),
    ]
    for i, (change, words) in enumerate(cases):
        (tmp_path / str(i)).mkdir()
        with pytest.raises(ConfigError) as err:
            _code_built(tmp_path / str(i), **change)
        assert words in err.value.message and "\n" not in err.value.message
    path = tmp_path / "d.toml"
    path.write_text(text())
    dep = load_deployment(path)
    with pytest.raises(ConfigError, match=r"\[autoscale\] scales decode, and the file has no \[\[decode\]\] table"):
        render(msgspec.structs.replace(dep, decode=[]), source="d.toml")
