"""Offline checks of the Helm chart in deploy/helm/epserve.

Renders the chart with Helm's own Go SDK (PyPI helm-python-sdk, no helm binary,
no cluster) for the default values, every example values file and a set of
variants; validates every object against the Kubernetes 1.33 API schemas
(kubernetes-validate, strict: unknown fields are errors) and with yamllint;
and checks that the objects wire together: Service selectors match pod labels,
ports match the flags the containers get, etcd endpoints match, referenced
Secrets exist, workers get Guaranteed QoS. When the epserve binary is built,
the flags the chart passes are checked against `epserve <role> --help`, and the
values `epserve plan --helm-values` writes are rendered too.

Run: deploy/ci-check.sh (or pytest deploy/tests in a venv with deploy/requirements.txt).
"""

from __future__ import annotations

import copy
import json
import os
import warnings
import re
import shutil
import subprocess
from pathlib import Path

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from yamllint import config as yamllint_config
from yamllint import linter

DEPLOY = Path(__file__).resolve().parent.parent
REPO = DEPLOY.parent
CHART = DEPLOY / "helm" / "epserve"
KUBE_VERSION = "1.33"
RELEASE = "ep"
NAMESPACE = "llm"
DOMAIN = "cluster.local"

# Example values files shipped with the chart.
EXAMPLES = sorted(CHART.glob("values-*.yaml"))

# Self-signed throwaway PEM-looking material: the chart only base64-encodes it.
FAKE_PEM = "-----BEGIN CERTIFICATE-----\nMIIBfake\n-----END CERTIFICATE-----\n"
FAKE_KEY = "-----BEGIN PRIVATE KEY-----\nMIIBfake\n-----END PRIVATE KEY-----\n"


def load_values(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def deep_merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


# name -> values layered on the chart's defaults. Secrets named in
# `existingSecret` values are expected to live outside the chart.
SCENARIOS: dict[str, dict] = {
    "default": {},
    "external-etcd": {
        "etcd": {"enabled": False, "external": {"endpoints": ["http://etcd-a.infra:2379", "http://etcd-b.infra:2379"]}},
    },
    "single-etcd-no-persistence": {"etcd": {"replicas": 1, "persistence": {"enabled": False}}},
    "model-hostpath": {"model": {"source": "hostPath", "hostPath": {"path": "/mnt/models"}, "path": "Mixtral-8x7B"}},
    "model-s3-hostpath-cache": {"model": {"source": "s3", "s3": {"uri": "s3://bucket/m/Qwen3-30B-A3B/", "region": "us-west-2"}}},
    "model-s3-emptydir": {
        "model": {"source": "s3", "s3": {"uri": "s3://bucket/m/x/", "cache": {"type": "emptyDir"}, "extraArgs": ["--no-progress"]}},
    },
    "attention-shards-servicemonitor": {
        "attentionWorkers": {"replicas": 4, "antiAffinity": "hard"},
        "expertWorkers": {"replicas": 6, "antiAffinity": "hard", "advertise": "podIP", "cores": "0-13", "expertDtype": "int8"},
        "metrics": {"workerPort": 9090, "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}}},
        "coordinator": {"replicas": 2, "maxModelLen": 8192, "kvCacheMemory": "8GiB", "kvCacheDtype": "bf16", "denseDtype": "int8", "microBatches": "2",
                        "dispatchDtype": "int8"},
        "model": {"servedModelName": ["a/b", "b"]},
    },
    "tls-inline-karpenter": {
        "tls": {"enabled": True, "cert": FAKE_PEM, "key": FAKE_KEY, "ca": FAKE_PEM},
        "scheduling": {"instanceFamilyLabel": "karpenter.k8s.aws/instance-family", "nodeAffinity": "preferred", "sameZone": False},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "existing-secrets-no-auth": {
        "auth": {"apiKey": {"enabled": False}, "adminToken": {"existingSecret": "ops-admin"}},
        "tls": {"enabled": True, "existingSecret": "ops-tls", "existingSecretHasCa": True},
        "serviceAccount": {"create": False, "name": "epserve-sa"},
        "scheduling": {"nodeAffinity": "none", "tolerations": [{"key": "graviton", "operator": "Exists", "effect": "NoSchedule"}]},
        "coordinator": {"service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]}},
    },
}
for example in EXAMPLES:
    SCENARIOS[example.name] = load_values(example)


def render(values: dict) -> list[dict]:
    """Renders the chart; returns the objects (NOTES.txt left out)."""
    chart = helm.Chart.load(str(CHART))
    manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("metadata", {}).setdefault("annotations", None)
                if doc["metadata"]["annotations"] is None:
                    del doc["metadata"]["annotations"]
                objects.append({"__source": path, **doc})
    return objects


def render_texts(values: dict) -> dict[str, str]:
    return helm.Chart.load(str(CHART)).render(values, name=RELEASE, namespace=NAMESPACE)


@pytest.fixture(scope="module", params=sorted(SCENARIOS), ids=sorted(SCENARIOS))
def scenario(request):
    values = SCENARIOS[request.param]
    merged = deep_merge(load_values(CHART / "values.yaml"), values)
    objs = render(values)
    return request.param, merged, objs


def strip(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k != "__source"}


def by_kind(objs, kind):
    return [o for o in objs if o["kind"] == kind]


def find(objs, kind, name):
    for o in objs:
        if o["kind"] == kind and o["metadata"]["name"] == name:
            return o
    raise AssertionError(f"no {kind} {name} among {[(o['kind'], o['metadata']['name']) for o in objs]}")


def workloads(objs):
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def containers(workload, init=False):
    spec = workload["spec"]["template"]["spec"]
    out = list(spec.get("containers", []))
    if init:
        out += spec.get("initContainers", [])
    return out


def flags(container) -> dict[str, list[str]]:
    """--flag=value arguments of a container (positional ones under "")."""
    out: dict[str, list[str]] = {}
    for arg in container.get("args", []):
        if arg.startswith("--"):
            name, _, value = arg.partition("=")
            out.setdefault(name, []).append(value)
        else:
            out.setdefault("", []).append(arg)
    return out


def one(container, flag):
    values = flags(container).get(flag)
    assert values and len(values) == 1, f"{container['name']}: expected one {flag}, got {values}"
    return values[0]


def named_port(container, name):
    for p in container.get("ports", []):
        if p["name"] == name:
            return p["containerPort"]
    raise AssertionError(f"{container['name']} has no port named {name}")


def fullname(component=None):
    base = f"{RELEASE}-epserve"
    return f"{base}-{component}" if component else base


# ---------------------------------------------------------------------------
# Rendering, lint, schemas, yamllint
# ---------------------------------------------------------------------------


def test_helm_lint_strict():
    for values in [{}] + [load_values(e) for e in EXAMPLES]:
        report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version="v1.33.0")
        bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
        assert not bad and not report.get("errors"), report


def test_objects_validate_against_kubernetes_schemas(scenario):
    name, _, objs = scenario
    assert objs, f"{name}: nothing rendered"
    for obj in objs:
        data = strip(obj)
        if data["apiVersion"].startswith("monitoring.coreos.com/"):
            check_service_monitor_shape(data)
            continue
        try:
            kubernetes_validate.validate(data, KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{name}: {obj['__source']}: {data['kind']}/{data['metadata']['name']}: {path}: {e.message}")


def check_service_monitor_shape(sm: dict):
    """The ServiceMonitor CRD is not in the bundled schemas: check the fields we use."""
    assert sm["kind"] == "ServiceMonitor"
    allowed_spec = {"endpoints", "selector", "namespaceSelector", "jobLabel"}
    assert set(sm["spec"]) <= allowed_spec, sm["spec"].keys()
    allowed_ep = {"port", "path", "interval", "scrapeTimeout", "scheme", "tlsConfig"}
    for ep in sm["spec"]["endpoints"]:
        assert set(ep) <= allowed_ep, ep.keys()
        assert re.fullmatch(r"\d+[smh]", ep["interval"]) and re.fullmatch(r"\d+[smh]", ep["scrapeTimeout"])
    assert sm["spec"]["selector"]["matchLabels"]


YAMLLINT_CONFIG = yamllint_config.YamlLintConfig(
    """
extends: default
rules:
  line-length: {max: 200}
  document-start: disable
  indentation: {spaces: consistent, indent-sequences: whatever}
  comments: {min-spaces-from-content: 1}
  comments-indentation: disable
  truthy: {check-keys: false}
"""
)


def test_rendered_yaml_is_clean(scenario):
    name, _, _ = scenario
    problems = []
    for path, text in render_texts(SCENARIOS[name]).items():
        if path.endswith("NOTES.txt") or not text.strip():
            continue
        # Helm starts multi-document templates with "\n---"; `helm template` output
        # puts a "# Source:" line there, so a leading newline is not a problem.
        for p in linter.run(text.lstrip("\n"), YAMLLINT_CONFIG):
            problems.append(f"{path}:{p.line}:{p.column}: {p.desc} ({p.rule})")
    assert not problems, f"{name}:\n" + "\n".join(problems)


def test_values_files_are_clean_yaml():
    problems = []
    for path in [CHART / "values.yaml", CHART / "Chart.yaml", *EXAMPLES]:
        for p in linter.run(path.read_text(encoding="utf-8"), YAMLLINT_CONFIG):
            problems.append(f"{path.name}:{p.line}:{p.column}: {p.desc} ({p.rule})")
    assert not problems, "\n".join(problems)


def test_values_yaml_is_documented_line_by_line():
    """Every key of values.yaml has a comment right above it, or sits inside a documented key."""
    undocumented = []
    stack: list[tuple[int, bool]] = []  # (indent, documented) of open mappings
    prev = ""
    for n, line in enumerate((CHART / "values.yaml").read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if not stripped:
            prev = ""
            continue
        if stripped.startswith("#"):
            prev = stripped
            continue
        indent = len(line) - len(line.lstrip())
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if stripped.startswith("- "):
            prev = ""
            continue
        m = re.match(r"([A-Za-z0-9_.\-/]+):(.*)$", stripped)
        if not m:
            prev = ""
            continue
        documented = prev.startswith("#") or any(d for _, d in stack)
        is_parent = m.group(2).strip() == ""
        if not documented and not is_parent:
            undocumented.append(f"values.yaml:{n}: {stripped}")
        if is_parent:
            stack.append((indent, prev.startswith("#") or any(d for _, d in stack)))
        prev = ""
    assert not undocumented, "keys without a comment:\n" + "\n".join(undocumented)


@pytest.mark.parametrize(
    "values, message",
    [
        ({"expertWorkers": {"resources": {"cpu": 7.5, "memory": "8Gi"}}}, "whole number"),
        ({"expertWorkers": {"resources": {"cpu": "500m", "memory": "8Gi"}}}, "whole number"),
        ({"model": {"source": "nfs"}}, "model.source must be"),
        ({"etcd": {"enabled": False}}, "etcd.external.endpoints"),
        ({"etcd": {"replicas": 2}}, "etcd.replicas must be 1, 3 or 5"),
        ({"tls": {"enabled": True}}, "tls.cert"),
        ({"model": {"source": "s3"}}, "model.s3.uri"),
        ({"expertWorkers": {"antiAffinity": "always"}}, "antiAffinity must be"),
        ({"scheduling": {"nodeAffinity": "sometimes"}}, "scheduling.nodeAffinity must be"),
        ({"expertWorkers": {"terminationGracePeriodSeconds": 60}}, "must exceed expertWorkers.drainTimeoutSeconds"),
    ],
)
def test_bad_values_fail_with_a_clear_message(values, message):
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert message in str(e.value), str(e.value)


# ---------------------------------------------------------------------------
# Wiring
# ---------------------------------------------------------------------------


def test_services_select_pods_and_ports_exist(scenario):
    name, _, objs = scenario
    pods = [(w, w["spec"]["template"]) for w in workloads(objs)]
    for svc in by_kind(objs, "Service"):
        sel = svc["spec"]["selector"]
        matching = [(w, t) for w, t in pods if sel.items() <= t["metadata"]["labels"].items()]
        assert matching, f"{name}: Service {svc['metadata']['name']} selects no pods ({sel})"
        for port in svc["spec"]["ports"]:
            target = port["targetPort"]
            for w, t in matching:
                cports = [p for c in t["spec"]["containers"] for p in c.get("ports", [])]
                ok = any(p["name"] == target for p in cports) if isinstance(target, str) else any(
                    p["containerPort"] == target for p in cports
                )
                assert ok, f"{name}: Service {svc['metadata']['name']} port {target} not on {w['metadata']['name']}"


def test_workload_selectors_match_their_templates(scenario):
    name, _, objs = scenario
    for w in workloads(objs):
        sel = w["spec"]["selector"]["matchLabels"]
        assert sel.items() <= w["spec"]["template"]["metadata"]["labels"].items(), f"{name}: {w['metadata']['name']}"
    for pdb in by_kind(objs, "PodDisruptionBudget"):
        sel = pdb["spec"]["selector"]["matchLabels"]
        assert any(sel.items() <= w["spec"]["template"]["metadata"]["labels"].items() for w in workloads(objs)), (
            f"{name}: PDB {pdb['metadata']['name']} selects nothing"
        )
    for sts in by_kind(objs, "StatefulSet"):
        svc = find(objs, "Service", sts["spec"]["serviceName"])
        assert svc["spec"].get("clusterIP") == "None", f"{name}: {sts['metadata']['name']}'s service is not headless"
        assert svc["spec"].get("publishNotReadyAddresses") is True
        assert svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()


def test_probes_use_existing_ports(scenario):
    name, _, objs = scenario
    for w in workloads(objs):
        for c in containers(w):
            names = {p["name"] for p in c.get("ports", [])}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                spec = c.get(probe)
                if not spec:
                    continue
                action = spec.get("httpGet") or spec.get("tcpSocket") or spec.get("grpc")
                port = action["port"]
                assert port in names or isinstance(port, int), f"{name}: {c['name']} {probe} port {port}"


def test_coordinator_flags_ports_and_draining(scenario):
    name, values, objs = scenario
    dep = find(objs, "Deployment", fullname("coordinator"))
    c = containers(dep)[0]
    assert c["args"][0] == "coordinator"
    assert int(one(c, "--port")) == named_port(c, "http") == values["coordinator"]["port"]
    assert int(one(c, "--admin-port")) == named_port(c, "admin") == values["coordinator"]["adminPort"]
    assert one(c, "--host") == "0.0.0.0"
    assert one(c, "--cluster") == (values.get("clusterName") or RELEASE)
    # The coordinator waits for every expert-worker before the first placement.
    assert int(one(c, "--expert-workers")) == values["expertWorkers"]["replicas"]
    # The API and admin Services are separate and target the right ports.
    api = find(objs, "Service", fullname("coordinator"))
    admin = find(objs, "Service", fullname("coordinator") + "-admin")
    assert [p["targetPort"] for p in api["spec"]["ports"]] == ["http"]
    assert [p["targetPort"] for p in admin["spec"]["ports"]] == ["admin"]
    # Readiness on /health; draining: preStop sleep, then SIGTERM with a long grace period.
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert "livenessProbe" in c
    assert c["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    spec = dep["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] > c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    # Serving flags from values.
    f = flags(c)
    assert f.get("--served-model-name", []) == list(values["model"]["servedModelName"])
    assert int(one(c, "--max-num-seqs")) == values["coordinator"]["maxNumSeqs"]
    if values["coordinator"]["maxModelLen"]:
        assert int(one(c, "--max-model-len")) == values["coordinator"]["maxModelLen"]
    else:
        assert "--max-model-len" not in f


def test_workers_listen_and_advertise_where_their_services_point(scenario):
    name, values, objs = scenario
    for component, key in (("expert-worker", "expertWorkers"), ("attention-worker", "attentionWorkers")):
        replicas = values[key]["replicas"]
        sts_name = fullname(component)
        if replicas == 0:
            assert not [o for o in objs if o["metadata"]["name"] == sts_name], f"{name}: {component} rendered at 0"
            continue
        sts = find(objs, "StatefulSet", sts_name)
        assert sts["spec"]["replicas"] == replicas
        c = containers(sts)[0]
        assert c["args"][0] == component
        port = named_port(c, "grpc")
        assert port == values[key]["port"]
        assert one(c, "--listen") == f"0.0.0.0:{port}"
        advertise = one(c, "--advertise")
        if values[key]["advertise"] == "dns":
            assert advertise == f"$(POD_NAME).{sts['spec']['serviceName']}.{NAMESPACE}.svc.{DOMAIN}:{port}"
        else:
            assert advertise == f"$(POD_IP):{port}"
        env = {e["name"]: e for e in c["env"]}
        for var in re.findall(r"\$\((\w+)\)", " ".join(c["args"])):
            assert var in env, f"{name}: {component} uses $({var}) without defining it"
        svc = find(objs, "Service", sts["spec"]["serviceName"])
        assert {p["port"] for p in svc["spec"]["ports"] if p["name"] == "grpc"} == {port}
        if component == "attention-worker":
            assert one(c, "--shard") == "$(EPSERVE_SHARD)"
            assert int(one(c, "--of")) == replicas
            ref = env["EPSERVE_SHARD"]["valueFrom"]["fieldRef"]["fieldPath"]
            assert ref == "metadata.labels['apps.kubernetes.io/pod-index']"
        if component == "expert-worker" and values[key]["cores"]:
            assert one(c, "--cores") == values[key]["cores"]
        if component == "expert-worker" and values[key]["expertDtype"]:
            assert one(c, "--expert-dtype") == values[key]["expertDtype"]


def test_workers_are_ready_by_grpc_health_and_expert_workers_drain_on_sigterm(scenario):
    name, values, objs = scenario
    for component, key in (("expert-worker", "expertWorkers"), ("attention-worker", "attentionWorkers")):
        if values[key]["replicas"] == 0:
            continue
        sts = find(objs, "StatefulSet", fullname(component))
        c = containers(sts)[0]
        # Readiness: Kubernetes' gRPC probe (grpc.health.v1.Health) on the worker's own port;
        # liveness stays TCP (NOT_SERVING while loading or draining must not kill the pod).
        assert c["readinessProbe"]["grpc"]["port"] == named_port(c, "grpc"), f"{name}: {component}"
        assert "grpc" not in c["livenessProbe"], f"{name}: {component}"
        if component == "expert-worker":
            drain = int(one(c, "--drain-timeout-secs"))
            assert drain == values[key]["drainTimeoutSeconds"]
            grace = sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
            assert grace >= drain + 5, f"{name}: grace {grace} s for a drain of up to {drain} s"


def test_expert_worker_grace_follows_the_drain_timeout():
    sts = find(render({"expertWorkers": {"drainTimeoutSeconds": 200}}), "StatefulSet", fullname("expert-worker"))
    assert int(one(containers(sts)[0], "--drain-timeout-secs")) == 200
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 230
    sts = find(
        render({"expertWorkers": {"drainTimeoutSeconds": 20, "terminationGracePeriodSeconds": 40}}),
        "StatefulSet",
        fullname("expert-worker"),
    )
    assert sts["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 40


def test_coordinator_waits_for_every_attention_shard(scenario):
    name, values, objs = scenario
    c = containers(find(objs, "Deployment", fullname("coordinator")))[0]
    n = values["attentionWorkers"]["replicas"]
    if n == 0:
        assert "--attention-workers" not in flags(c)
        return
    # The coordinator finds shards 0..n-1 in etcd; each worker is shard $(EPSERVE_SHARD) of n.
    assert int(one(c, "--attention-workers")) == n
    sts = find(objs, "StatefulSet", fullname("attention-worker"))
    w = containers(sts)[0]
    assert int(one(w, "--of")) == n
    assert one(w, "--block-size") == one(c, "--block-size")
    # The attention-workers hold the KV cache and the attention projections:
    # they store and run them as the coordinator says.
    for key, flag in (("kvCacheDtype", "--kv-cache-dtype"), ("denseDtype", "--dense-dtype")):
        dtype = values["coordinator"].get(key)
        if dtype:
            assert one(c, flag) == dtype
            assert one(w, flag) == dtype
        else:
            assert flag not in flags(w)


def test_coordinator_precision_flags_follow_values(scenario):
    name, values, objs = scenario
    c = containers(find(objs, "Deployment", fullname("coordinator")))[0]
    for key, flag in (
        ("denseDtype", "--dense-dtype"),
        ("kvCacheDtype", "--kv-cache-dtype"),
        ("microBatches", "--micro-batches"),
        ("dispatchDtype", "--dispatch-dtype"),
    ):
        if values["coordinator"].get(key):
            assert one(c, flag) == values["coordinator"][key]
        else:
            assert flag not in flags(c)


def test_etcd_endpoints_match(scenario):
    name, values, objs = scenario
    epserve = [c for w in workloads(objs) for c in containers(w) if c["name"] != "etcd"]
    endpoints = {one(c, "--etcd") for c in epserve}
    assert len(endpoints) == 1, f"{name}: pods disagree on --etcd: {endpoints}"
    (endpoint,) = endpoints
    if not values["etcd"]["enabled"]:
        assert endpoint == ",".join(values["etcd"]["external"]["endpoints"])
        assert not [o for o in objs if o["metadata"]["name"].startswith(fullname("etcd"))]
        return
    svc = find(objs, "Service", fullname("etcd"))
    (client,) = [p for p in svc["spec"]["ports"] if p["name"] == "client"]
    assert endpoint == f"http://{svc['metadata']['name']}.{NAMESPACE}.svc.{DOMAIN}:{client['port']}"
    sts = find(objs, "StatefulSet", fullname("etcd"))
    etcd = containers(sts)[0]
    assert named_port(etcd, "client") == client["port"] or client["targetPort"] == "client"
    assert one(etcd, "--listen-client-urls") == f"http://0.0.0.0:{named_port(etcd, 'client')}"
    # The initial cluster names every member by its peer DNS name.
    replicas = values["etcd"]["replicas"]
    assert sts["spec"]["replicas"] == replicas
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    peers = sts["spec"]["serviceName"]
    peer_port = named_port(etcd, "peer")
    members = one(etcd, "--initial-cluster").split(",")
    assert members == [
        f"{sts['metadata']['name']}-{i}=http://{sts['metadata']['name']}-{i}.{peers}.{NAMESPACE}.svc.{DOMAIN}:{peer_port}"
        for i in range(replicas)
    ]
    assert one(etcd, "--initial-advertise-peer-urls") == f"http://$(POD_NAME).{peers}.{NAMESPACE}.svc.{DOMAIN}:{peer_port}"
    if values["etcd"]["persistence"]["enabled"]:
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "data"
        assert claim["spec"]["resources"]["requests"]["storage"] == values["etcd"]["persistence"]["size"]
    else:
        assert "volumeClaimTemplates" not in sts["spec"]


def test_referenced_secrets_exist(scenario):
    name, values, objs = scenario
    rendered = {o["metadata"]["name"] for o in by_kind(objs, "Secret")}
    external = {
        values["auth"]["apiKey"]["existingSecret"],
        values["auth"]["adminToken"]["existingSecret"],
        values["tls"]["existingSecret"],
    } - {""}
    for w in workloads(objs):
        spec = w["spec"]["template"]["spec"]
        refs = []
        for c in containers(w, init=True):
            for e in c.get("env", []):
                ref = e.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    refs.append((ref["name"], ref["key"]))
        for v in spec.get("volumes", []):
            if "secret" in v:
                refs.append((v["secret"]["secretName"], None))
        for secret, key in refs:
            if secret in external:
                continue
            assert secret in rendered, f"{name}: {w['metadata']['name']} needs Secret {secret}"
            if key:
                data = find(objs, "Secret", secret)["data"]
                assert key in data, f"{name}: Secret {secret} lacks {key}"
    c = containers(find(objs, "Deployment", fullname("coordinator")))[0]
    env = {e["name"] for e in c["env"]}
    assert "EPSERVE_ADMIN_TOKEN" in env
    assert ("EPSERVE_API_KEY" in env) == values["auth"]["apiKey"]["enabled"]
    if values["tls"]["enabled"]:
        for w in workloads(objs):
            if w["metadata"]["name"] == fullname("etcd"):
                continue
            c = containers(w)[0]
            mount = values["tls"]["mountPath"]
            assert one(c, "--tls-cert") == f"{mount}/tls.crt"
            assert any(m["name"] == "tls" and m["mountPath"] == mount for m in c["volumeMounts"])


def test_epserve_pods_get_guaranteed_qos_and_arm64(scenario):
    name, values, objs = scenario
    for w in workloads(objs):
        spec = w["spec"]["template"]["spec"]
        assert spec["nodeSelector"]["kubernetes.io/arch"] == values["scheduling"]["arch"]
        if w["metadata"]["name"] == fullname("etcd"):
            continue
        for c in containers(w, init=True):
            r = c["resources"]
            assert r["requests"] == r["limits"], f"{name}: {c['name']} requests != limits"
            cpu = r["limits"]["cpu"]
            assert re.fullmatch(r"[1-9]\d*", str(cpu)), f"{name}: {c['name']} cpu {cpu} is not a whole number"
            assert r["limits"]["memory"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        main = containers(w)[0]
        assert main["securityContext"]["readOnlyRootFilesystem"] is True


def test_scheduling_affinity(scenario):
    name, values, objs = scenario
    s = values["scheduling"]
    for component, key in (("expert-worker", "expertWorkers"), ("attention-worker", "attentionWorkers")):
        if values[key]["replicas"] == 0:
            continue
        aff = find(objs, "StatefulSet", fullname(component))["spec"]["template"]["spec"].get("affinity", {})
        families = values[key]["instanceFamilies"] or s["instanceFamilies"]
        if s["nodeAffinity"] == "none":
            assert "nodeAffinity" not in aff
        else:
            na = aff["nodeAffinity"]
            if s["nodeAffinity"] == "required":
                (term,) = na["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
                exprs = term["matchExpressions"]
            else:
                exprs = na["preferredDuringSchedulingIgnoredDuringExecution"][0]["preference"]["matchExpressions"]
            (expr,) = exprs
            if s["instanceFamilyLabel"]:
                assert expr["key"] == s["instanceFamilyLabel"] and expr["values"] == families
            else:
                assert expr["key"] == "node.kubernetes.io/instance-type"
                assert expr["values"] == [f"{f}.{z}" for f in families for z in s["instanceSizes"]]
        anti = values[key]["antiAffinity"]
        labels = find(objs, "StatefulSet", fullname(component))["spec"]["template"]["metadata"]["labels"]
        if anti == "hard":
            (term,) = aff["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        elif anti == "soft":
            term = aff["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
        else:
            assert "podAntiAffinity" not in aff
            continue
        assert term["topologyKey"] == "kubernetes.io/hostname"
        assert term["labelSelector"]["matchLabels"].items() <= labels.items()
        if s["sameZone"]:
            zone = aff["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
            assert zone["topologyKey"] == "topology.kubernetes.io/zone"
            coord = find(objs, "Deployment", fullname("coordinator"))["spec"]["template"]["metadata"]["labels"]
            assert zone["labelSelector"]["matchLabels"].items() <= coord.items()


def test_model_volume_and_path(scenario):
    name, values, objs = scenario
    m = values["model"]
    model_dir = f"{m['mountPath'].rstrip('/')}/{m['path'].lstrip('/')}"
    for w in workloads(objs):
        if w["metadata"]["name"] == fullname("etcd"):
            continue
        spec = w["spec"]["template"]["spec"]
        (vol,) = [v for v in spec["volumes"] if v["name"] == "model"]
        c = containers(w)[0]
        assert one(c, "--model") == model_dir
        (mount,) = [v for v in c["volumeMounts"] if v["name"] == "model"]
        assert mount["mountPath"] == m["mountPath"] and mount["readOnly"] is True
        inits = spec.get("initContainers", [])
        if m["source"] == "pvc":
            assert vol["persistentVolumeClaim"] == {"claimName": m["pvc"]["claimName"], "readOnly": True}
            assert not inits
        elif m["source"] == "hostPath":
            assert vol["hostPath"]["path"] == m["hostPath"]["path"]
            assert not inits
        else:
            cache = m["s3"]["cache"]
            if cache["type"] == "hostPath":
                assert vol["hostPath"] == {"path": cache["hostPath"], "type": "DirectoryOrCreate"}
            else:
                assert "emptyDir" in vol
            (init,) = inits
            env = {e["name"]: e.get("value") for e in init["env"]}
            assert env["MODEL_URI"] == m["s3"]["uri"]
            assert env["MODEL_PATH"] == m["path"].lstrip("/")
            assert any(v["name"] == "model" and v["mountPath"] == "/cache" for v in init["volumeMounts"])
            assert init["args"][2:] == list(m["s3"]["extraArgs"])


def test_metrics_scraping(scenario):
    name, values, objs = scenario
    dep = find(objs, "Deployment", fullname("coordinator"))
    ann = dep["spec"]["template"]["metadata"].get("annotations", {})
    if values["metrics"]["podAnnotations"]:
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/port"] == str(named_port(containers(dep)[0], "http"))
    monitors = by_kind(objs, "ServiceMonitor")
    if not values["metrics"]["serviceMonitor"]["enabled"]:
        assert not monitors
        return
    assert monitors
    for sm in monitors:
        sel = sm["spec"]["selector"]["matchLabels"]
        port = sm["spec"]["endpoints"][0]["port"]
        svcs = [
            s for s in by_kind(objs, "Service")
            if sel.items() <= s["metadata"]["labels"].items() and any(p["name"] == port for p in s["spec"]["ports"])
        ]
        assert svcs, f"{name}: ServiceMonitor {sm['metadata']['name']} finds no Service with port {port}"
        for k, v in values["metrics"]["serviceMonitor"]["labels"].items():
            assert sm["metadata"]["labels"][k] == v


# ---------------------------------------------------------------------------
# The epserve binary: flags and plan
# ---------------------------------------------------------------------------

ROLES = {"coordinator": "coordinator", "expert-worker": "expert-worker", "attention-worker": "attention-worker"}
# Flags only rendered with optional values whose support in the binary may lag
# (reported, not failed): worker metrics port and TLS files.
OPTIONAL_FLAGS = {"--metrics-port", "--tls-cert", "--tls-key", "--tls-ca"}


def epserve_binary() -> Path | None:
    env = os.environ.get("EPSERVE_BIN")
    if env:
        return Path(env)
    for profile in ("debug", "release"):
        p = REPO / "target" / profile / "epserve"
        if p.is_file():
            return p
    found = shutil.which("epserve")
    return Path(found) if found else None


def help_flags(binary: Path, role: str) -> set[str] | None:
    top = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=60)
    if not re.search(rf"^\s+{re.escape(role)}\s", top.stdout, re.M):
        return None
    out = subprocess.run([str(binary), role, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", out.stdout))


def test_chart_flags_exist_in_the_binary():
    binary = epserve_binary()
    if binary is None:
        pytest.skip("no epserve binary built (cargo build --bin epserve, or set EPSERVE_BIN)")
    checked = []
    for role in ROLES:
        known = help_flags(binary, role)
        if known is None:
            continue  # the role is not in this build yet
        missing_required: set[str] = set()
        missing_optional: set[str] = set()
        for name, values in SCENARIOS.items():
            for w in workloads(render(values)):
                for c in containers(w):
                    if c["args"][0] != role:
                        continue
                    for flag in flags(c):
                        if flag and flag not in known:
                            (missing_optional if flag in OPTIONAL_FLAGS else missing_required).add(flag)
        if missing_optional:
            warnings.warn(f"epserve {role} lacks optional chart flags {sorted(missing_optional)}")
        assert not missing_required, f"`epserve {role}` does not accept {sorted(missing_required)} (deploy/helm/epserve/templates/_args.tpl)"
        checked.append(role)
    if not checked:
        pytest.skip("none of the roles the chart runs is in this epserve build yet")


QWEN3_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("target, dtype", [(100, "bf16"), (500, "bf16"), (900, "int8")])
def test_plan_values_render_and_validate(tmp_path, target, dtype):
    binary = epserve_binary()
    if binary is None or help_flags(binary, "plan") is None:
        pytest.skip("no epserve binary with `plan` built")
    model = tmp_path / "Qwen3-30B-A3B"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_CONFIG))
    out = tmp_path / "plan.yaml"
    run = subprocess.run(
        [str(binary), "plan", "--model", str(model), "--instance", "c8g.16xlarge",
         "--target-output-tps", str(target), "--expert-dtype", dtype, "--helm-values", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "decode throughput by batch size" in run.stdout
    plan_values = load_values(out)
    problems = [f"{p.line}: {p.desc}" for p in linter.run(out.read_text(), YAMLLINT_CONFIG)]
    assert not problems, problems
    objs = render(plan_values)
    for obj in objs:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            continue
        kubernetes_validate.validate(strip(obj), KUBE_VERSION, strict=True)
    sts = find(objs, "StatefulSet", fullname("expert-worker"))
    assert sts["spec"]["replicas"] == plan_values["expertWorkers"]["replicas"] >= 1
    c = containers(sts)[0]
    assert c["resources"]["limits"]["cpu"] == str(plan_values["expertWorkers"]["resources"]["cpu"])
    assert one(c, "--model") == "/models/Qwen3-30B-A3B"
    assert flags(c).get("--expert-dtype") == (["int8"] if dtype == "int8" else None)
