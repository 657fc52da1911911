"""`pdkv.k8s.render`: every object valid for Kubernetes 1.30-1.37 (and the LWS CRD), and the rules that make P/D run."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
from support.k8s_objects import (
    EXAMPLES, K8S_VERSIONS, containers, deployment_text, env_of, flag, pod_templates, render_file, render_text, validate,
)

from pdkv.bootstrap import TOKEN_ENV
from pdkv.deploy.plan.loader import load_deployment
from pdkv.deploy.plan.topology import deployment_parts
from pdkv.errors import ConfigError
from pdkv.deploy.plan.engine import kv_transfer_config

FILES = {"1p1d": EXAMPLES / "k8s-1p1d.toml", "4p2d": EXAMPLES / "k8s-4p2d.toml"}


VARIANTS = {
    **{name: None for name in FILES},
    "tcp-no-doctor-token": deployment_text(
        top='transport = "tcp"', kubernetes='doctor = false\ntoken_secret = "tok"\nanti_affinity = "required"'),
    "tp2-mixed": deployment_text(
        prefill="tp = 8\nreplicas = 3", decode="tp = 8\nreplicas = 2", kubernetes="gpus_per_node = 8\nmodel_pvc = 'weights'"),
    "cpu-tcp": deployment_text(top='platform = "cpu"\ntransport = "tcp"\nblock_size = 32'),
    "socket-tp2": deployment_text(top='transport = "socket"\nblock_size = 16', decode="tp = 2", kubernetes="socket_port = 6100"),
    "tp-p1-d2": deployment_text(prefill="tp = 1", decode="tp = 2"),  # P and D of different TP sizes
    "no-kv-events": deployment_text(top='block_size = 16\nkv_events = false', decode="kv_events_port = 7000"),
    "external-bootstrap": deployment_text(tables='[bootstrap]\nmode = "external"\nurl = "http://registry.example:8998"'),
    "autoscale-keda": deployment_text(
        prefill="tp = 8", tables='[autoscale]\nprofile = "p.json"\nttft_ms = 500\nitl_ms = 40\nkubernetes = "keda"'),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def rendered(request, tmp_path_factory) -> list[dict]:
    text = VARIANTS[request.param]
    if text is None:
        return render_file(FILES[request.param])
    return render_text(tmp_path_factory.mktemp(request.param), text)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered, version):
    assert rendered
    for obj in rendered:
        validate(obj, version)


def test_the_validation_refuses_a_misspelled_field():
    objects = render_file(FILES["4p2d"])
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment, "1.30")
    lws = next(o for o in objects if o["kind"] == "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate(lws, "1.30")


def test_selectors_match_their_pod_labels_and_no_other_parts(rendered):
    workloads = [o for o in rendered if o["kind"] == "Deployment"]
    for obj in workloads:
        sel = obj["spec"]["selector"]["matchLabels"]
        assert sel.items() <= obj["spec"]["template"]["metadata"]["labels"].items()
        others = [t for o, _, t in pod_templates(rendered) if o is not obj]
        assert not any(sel.items() <= t["metadata"]["labels"].items() for t in others), obj["metadata"]["name"]


def test_services_select_the_pods_they_mean_on_a_declared_port(rendered):
    services = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Service"}
    for name, svc in services.items():
        role = name.rsplit("-", 1)[1]
        picked = [t for _, _, t in pod_templates(rendered) if svc["spec"]["selector"].items() <= t["metadata"]["labels"].items()]
        assert picked and all(t["metadata"]["labels"]["pdkv/role"] == role for t in picked), name
        for p in svc["spec"]["ports"]:
            declared = {cp["name"]: cp["containerPort"] for t in picked for c in containers(t) for cp in c["ports"]}
            assert declared[p["targetPort"]] == p["port"]


def _engines(rendered):
    for obj, kind, template in pod_templates(rendered):
        role = template["metadata"]["labels"]["pdkv/role"]
        if role in ("prefill", "decode"):
            yield obj, kind, role, template


def test_every_port_an_engine_uses_is_declared(rendered):
    for _, kind, role, template in _engines(rendered):
        (c,) = containers(template)
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        assert len(set(declared.values())) == len(declared)
        env = env_of(c)
        low, high = int(env["MC_MIN_RPC_PORT"]["value"]), int(env["MC_MAX_RPC_PORT"]["value"])
        assert {v for n, v in declared.items() if n.startswith("mooncake-")} == set(range(low, high + 1))
        if kind == "worker":
            assert "http" not in declared and "startupProbe" not in c and "--kv-events-config" not in c["command"]
            continue
        if flag(c["command"], "--kv-events-config") is None:  # kv_events = false: nothing published, nothing declared
            assert not {"kv-events", "kv-replay"} & set(declared)
        else:  # the proxy's kv-aware policy follows them, at the pod's address its member record names
            events = json.loads(flag(c["command"], "--kv-events-config"))
            assert events["endpoint"] == f"tcp://*:{declared['kv-events']}"
            assert events["replay_endpoint"] == f"tcp://*:{declared['kv-replay']}"
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert int(flag(c["command"], "--port")) == declared["http"]
        assert env["PDKV_ADVERTISE_URL"]["value"] == f"http://$(VLLM_HOST_IP):{declared['http']}"
        if role == "prefill":
            assert env["VLLM_MOONCAKE_BOOTSTRAP_PORT"]["value"] == str(declared["bootstrap"])
        if kind == "leader":
            assert int(flag(c["command"], "--master-port")) == declared["dist"]
        for init in template["spec"].get("initContainers", []):
            ports = [int(p) for p in re.findall(r"--port (\d+)", init["command"][-1])]
            assert ports and set(ports) <= set(declared.values())


def test_members_registry_is_the_bootstrap_service_for_engines_and_proxy(rendered):
    services = {o["metadata"]["name"]: o for o in rendered if o["kind"] == "Service"}
    boot = next((s for n, s in services.items() if n.endswith("-bootstrap")), None)
    if boot is None:  # an external registry
        url = "http://registry.example:8998"
    else:
        md = boot["metadata"]
        url = f"http://{md['name']}.{md['namespace']}.svc:{boot['spec']['ports'][0]['port']}"
    for _, _, _, template in _engines(rendered):
        assert env_of(containers(template)[0])["PDKV_MEMBERS_URL"]["value"] == url
    proxy = next(o for o in rendered if o["kind"] == "Deployment" and o["metadata"]["name"].endswith("-proxy"))
    assert flag(containers(proxy["spec"]["template"])[0]["command"], "--members") == url


def _kv_config(rendered, template) -> dict:
    c = containers(template)[0]
    value = flag(c["command"], "--kv-transfer-config")
    if value == "$(PDKV_KV_TRANSFER_CONFIG)":
        ref = env_of(c)["PDKV_KV_TRANSFER_CONFIG"]["valueFrom"]["configMapKeyRef"]
        cm = next(o for o in rendered if o["kind"] == "ConfigMap" and o["metadata"]["name"] == ref["name"])
        value = cm["data"][ref["key"]]
        assert template["metadata"]["annotations"]["pdkv/kv-transfer-config-sha256"] == hashlib.sha256(value.encode()).hexdigest()
    return json.loads(value)


def test_every_side_channel_of_a_prefill_is_declared(rendered):
    for _, _, role, template in _engines(rendered):
        (c,) = containers(template)
        declared = {p["name"]: p["containerPort"] for p in c["ports"]}
        extra = _kv_config(rendered, template)["kv_connector_extra_config"]
        tp = int(flag(c["command"], "--tensor-parallel-size") or 1)
        if role == "prefill":
            base = extra["side_channel_port"]
            assert {v for n, v in declared.items() if n.startswith("side-")} == set(range(base, base + tp))
        else:
            assert "side_channel_port" not in extra and not any(n.startswith("side-") for n in declared)
        # Protocol socket: every D rank's KV listener on a fixed, declared port (the pod's own address).
        sock = {v for n, v in declared.items() if n.startswith("kv-sock-")}
        if role == "decode" and extra.get("mooncake_protocol") == "socket":
            assert sock == set(range(extra["socket_port"], extra["socket_port"] + tp))
        else:
            assert not sock and "socket_port" not in extra


def test_p_and_d_agree_on_model_block_size_and_connector_and_their_tp_sizes_divide(rendered):
    seen, tps = {}, set()
    for _, kind, role, template in _engines(rendered):
        argv = containers(template)[0]["command"]
        config = _kv_config(rendered, template)
        extra = config["kv_connector_extra_config"]
        assert config["kv_role"] == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        facts = (tuple(argv[:3]), flag(argv, "--block-size"), config["kv_connector"],
                 config["kv_connector_module_path"], extra["mooncake_protocol"], extra.get("device_name"))
        tps.add(int(flag(argv, "--tensor-parallel-size") or 1))
        seen.setdefault(facts, set()).add(role)
        if role == "prefill" and kind == "worker":  # its leader's in-worker bootstrap, reached by the LWS leader's name
            assert extra["bootstrap_server_address"] == "$(LWS_LEADER_ADDRESS):8998"
        else:
            assert "bootstrap_server_address" not in extra
    assert len(seen) == 1 and seen.popitem()[1] == {"prefill", "decode"}
    assert max(tps) % min(tps) == 0


def test_addresses_come_from_the_pod_ip(rendered):
    for obj, kind, _, template in _engines(rendered):
        c = containers(template)[0]
        env = c["env"]
        assert env[0] == {"name": "VLLM_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
        defined = set()
        for e in env:  # $(VAR) in a value expands only variables defined above it
            assert set(re.findall(r"\$\((\w+)\)", e.get("value", ""))) <= defined, e
            defined.add(e["name"])
        lws = {"LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX"} if obj["kind"] == "LeaderWorkerSet" else set()
        assert set(re.findall(r"\$\((\w+)\)", " ".join(c["command"]))) <= defined | lws
        assert not re.search(r"\b(127\.0\.0\.1|10\.\d+\.\d+\.\d+)\b", json.dumps(c))


def test_engine_pods_have_what_rdma_pd_needs(rendered):
    for obj, kind, role, template in _engines(rendered):
        spec = template["spec"]
        (c,) = spec["containers"]
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        shm = next(v for v in spec["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        assert spec["terminationGracePeriodSeconds"] >= 60 and spec["enableServiceLinks"] is False
        if kind != "worker":  # vLLM drains the requests in flight within the grace period instead of aborting them
            assert 0 < int(flag(c["command"], "--shutdown-timeout")) < spec["terminationGracePeriodSeconds"]
        if c["command"][0] == "python3":  # a CPU engine (vLLM's API server module): no devices
            assert "resources" not in c and not any("rdma" in json.dumps(i) for i in spec.get("initContainers", []))
            continue
        res = c["resources"]
        assert res["requests"] == res["limits"]
        tp = int(flag(c["command"], "--tensor-parallel-size") or 1)
        nodes = obj["spec"]["leaderWorkerTemplate"]["size"] if obj["kind"] == "LeaderWorkerSet" else 1
        assert int(res["requests"]["nvidia.com/gpu"]) * nodes == tp
        rdma = [k for k in res["requests"] if k.startswith("rdma/")]
        assert len(rdma) == (1 if '"mooncake_protocol":"rdma"' in json.dumps(_kv_config(rendered, template), separators=(",", ":"))
                             else 0)
        for init in spec.get("initContainers", []):
            assert init["name"] == "doctor" and init["resources"] == res
            assert "2>/dev/termination-log" in init["command"][-1]


def test_the_examples_carry_their_kubernetes_settings():
    one = render_file(FILES["1p1d"])
    four = render_file(FILES["4p2d"])
    assert [o["kind"] for o in four].count("LeaderWorkerSet") == 2
    lws = {o["metadata"]["name"]: o["spec"] for o in four if o["kind"] == "LeaderWorkerSet"}
    assert {n: (s["replicas"], s["leaderWorkerTemplate"]["size"]) for n, s in lws.items()} == {
        "qwen3-8b-4p2d-prefill-0": (4, 2), "qwen3-8b-4p2d-decode-0": (2, 2)}
    p_leader = lws["qwen3-8b-4p2d-prefill-0"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]
    term = p_leader["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert term["labelSelector"]["matchLabels"]["pdkv/role"] == "decode"
    assert env_of(p_leader["containers"][0])[TOKEN_ENV]["valueFrom"]["secretKeyRef"] == {"name": "pdkv-bootstrap-token", "key": "token"}
    assert p_leader["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": "4", "rdma/rdma_shared_device_a": "1"}
    kinds = {(o["kind"], o["metadata"]["name"]) for o in one}
    assert ("Deployment", "qwen3-8b-prefill-0") in kinds and ("Service", "qwen3-8b-proxy") in kinds
    assert all(o["metadata"]["namespace"] == "pdkv" for o in one)


def test_the_kv_transfer_config_is_the_one_pdkv_up_passes():
    path = FILES["1p1d"]
    objects = render_file(path)
    data = next(o for o in objects if o["kind"] == "ConfigMap")["data"]
    up = {p.launch.name: p.spec for p in deployment_parts(load_deployment(path)) if p.spec is not None}
    assert json.loads(data["decode-0.json"]) == kv_transfer_config(up["decode-0"])
    p_up = kv_transfer_config(up["prefill-0"])
    del p_up["kv_connector_extra_config"]["bootstrap_server_address"]  # pdkv up's standalone bootstrap; the pod's is in-worker
    p_up["kv_connector_extra_config"]["side_channel_port"] = 5600  # a pod declares its side channel's ports
    assert json.loads(data["prefill-0.json"]) == p_up


def test_scaling_a_role_changes_its_replicas_alone(tmp_path: Path):
    text = FILES["4p2d"].read_text()
    assert "replicas = 4\n" in text
    before = render_file(FILES["4p2d"])
    after = render_text(tmp_path, text.replace("replicas = 4\n", "replicas = 9\n"))
    changed = [(a["kind"], a["metadata"]["name"]) for a, b in zip(after, before, strict=True) if a != b]
    assert changed == [("LeaderWorkerSet", "qwen3-8b-4p2d-prefill-0")]  # the proxy, its argv and the registry stay as they are
    assert next(o for o in after if o["kind"] == "LeaderWorkerSet")["spec"]["replicas"] == 9


def test_each_engine_carries_its_own_tp(tmp_path: Path):
    objects = render_text(tmp_path, VARIANTS["tp-p1-d2"])
    tp = {role: flag(containers(t)[0]["command"], "--tensor-parallel-size") for _, _, role, t in _engines(objects)}
    gpus = {role: containers(t)[0]["resources"]["limits"]["nvidia.com/gpu"] for _, _, role, t in _engines(objects)}
    assert tp == {"prefill": None, "decode": "2"} and gpus == {"prefill": "1", "decode": "2"}


def test_namespace_override_reaches_every_object_and_the_members_url():
    objects = render_file(FILES["1p1d"], namespace="serving")
    assert {o["metadata"]["namespace"] for o in objects} == {"serving"}
    assert "qwen3-8b-bootstrap.serving.svc:8998" in json.dumps(objects)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (deployment_text(kubernetes='imagee = "x"'), "imagee"),
        (deployment_text(prefill="tp = 3"), "tp = 3, which does not divide gpus_per_node = 8"),
        (deployment_text(prefill="tp = 12", kubernetes="gpus_per_node = 8"), "which 8 does not divide"),
        (deployment_text(kubernetes='rdma_resource = "rdma ib"'), "is not a Kubernetes resource name"),
        (deployment_text(kubernetes='gpu_resource = "gpu"'), "is not a Kubernetes resource name"),
        (deployment_text(kubernetes='name = "Qwen_3"'), "is not a Kubernetes name"),
        (deployment_text(kubernetes='shm_size = "lots"'), "is not a Kubernetes quantity"),
        (deployment_text(top='connector = "mooncake"'), "members"),
        (deployment_text(top='transport = "cma"\nplatform = "cpu"\nblock_size = 32'), "inside one host"),
        (deployment_text(prefill='bootstrap_url = "http://10.0.0.9:8998"'), "bootstrap_url"),
        (deployment_text(decode="block_size = 32"), "block size differs: P 16, D 32"),
        (deployment_text(prefill="replicas = 0"), "replicas = 0"),
        (deployment_text(decode='env = { VLLM_HOST_IP = "10.0.0.3" }'), "sets VLLM_HOST_IP in env"),
    ],
)
def test_bad_input_is_one_config_error(tmp_path: Path, text: str, words: str):
    with pytest.raises(ConfigError) as err:
        render_text(tmp_path, text)
    assert words in err.value.message and "\n" not in err.value.message


def test_pdkv_up_reads_the_file_and_refuses_replicas(tmp_path: Path):
    parts = deployment_parts(load_deployment(FILES["1p1d"]))
    assert [p.launch.name for p in parts] == ["bootstrap-0", "prefill-0", "decode-0", "proxy"]
    with pytest.raises(ConfigError, match="pdkv up starts one engine per table"):
        deployment_parts(load_deployment(FILES["4p2d"]))


@pytest.fixture(scope="module")
def vllm_serve_parser():
    pytest.importorskip("vllm")
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm")
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    return parser


@pytest.mark.parametrize("example", sorted(FILES))
def test_vllms_own_parser_reads_every_engine_command(vllm_serve_parser, example):
    objects = render_file(FILES[example])
    expand = {"$(LWS_LEADER_ADDRESS)": "qwen3-0.qwen3.pdkv", "$(LWS_WORKER_INDEX)": "1"}
    for _, kind, role, template in _engines(objects):
        argv = containers(template)[0]["command"]
        config = json.dumps(_kv_config(objects, template))
        words = [config if w == "$(PDKV_KV_TRANSFER_CONFIG)" else w for w in argv]
        for var, value in expand.items():
            words = [w.replace(var, value) for w in words]
        assert words[:2] == ["vllm", "serve"]
        args = vllm_serve_parser.parse_args(words[1:])
        assert args.model_tag == argv[2] and args.kv_transfer_config.kv_connector == "PdkvConnector"
        assert args.kv_transfer_config.kv_role == {"prefill": "kv_producer", "decode": "kv_consumer"}[role]
        assert args.headless is (kind == "worker")
        assert args.nnodes == (2 if kind in ("leader", "worker") else 1)
        assert args.node_rank == (1 if kind == "worker" else 0)


def test_engines_publish_kv_events_unless_the_file_turns_them_off(tmp_path):
    def commands(text: str) -> list[list[str]]:
        folder = tmp_path / str(len(text))
        folder.mkdir()
        return [containers(t)[0]["command"] for _, kind, _, t in _engines(render_text(folder, text)) if kind != "worker"]

    assert all(flag(c, "--kv-events-config") for c in commands(deployment_text()))
    assert not any("--kv-events-config" in c for c in commands(VARIANTS["no-kv-events"]))


def test_a_data_parallel_engine_declares_a_publisher_and_a_replay_port_per_rank(tmp_path):
    text = deployment_text(prefill='extra_args = ["--data-parallel-size", "2"]')
    (_, _, _, template), *_ = [e for e in _engines(render_text(tmp_path, text)) if e[2] == "prefill"]
    (c,) = containers(template)
    declared = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert [declared[n] for n in ("kv-events-0", "kv-events-1", "kv-replay-0", "kv-replay-1")] == [5557, 5558, 5559, 5560]
    events = json.loads(flag(c["command"], "--kv-events-config"))
    assert (events["endpoint"], events["replay_endpoint"]) == ("tcp://*:5557", "tcp://*:5559")
