"""Offline checks of the Helm chart in deploy/helm/epserve.

Renders the chart with Helm's own Go SDK (PyPI helm-python-sdk, no helm binary,
no cluster) for the default values, every example values file and a set of
variants; validates every object against the Kubernetes 1.33 API schemas
(kubernetes-validate, strict: unknown fields are errors) and with yamllint;
and checks that the objects wire together: Service selectors match pod labels,
ports match the flags the containers get, etcd endpoints match, referenced
Secrets exist, workers get Guaranteed QoS; with TLS on, every link is wired
(certificates mounted, flags passed, etcd served over TLS with client-cert
auth) and the cert-manager certificates name the addresses peers dial; the
NetworkPolicies let only the right pods in. When the epserve binary is built,
every flag the chart passes to an epserve container must be accepted by
`epserve <role> --help` (strict: an unknown flag fails; see PENDING_FLAGS),
and the values `epserve plan --helm-values` writes are rendered too.

Run: deploy/ci-check.sh (or pytest deploy/tests in a venv with deploy/requirements.txt).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
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
        "expertWorkers": {"replicas": 6, "antiAffinity": "hard", "advertise": "podIP", "cores": "0-13", "expertDtype": "int8",
                          "expertMemory": "20GiB"},
        "metrics": {"serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                    "grafanaDashboard": {"enabled": True, "annotations": {"grafana_folder": "LLM"}}},
        "coordinator": {"replicas": 2, "maxModelLen": 8192, "kvCacheMemory": "8GiB", "kvCacheDtype": "bf16", "denseDtype": "int8", "microBatches": "2",
                        "dispatchDtype": "int8", "expertPrecisionPolicy": "load", "expertBf16Share": 0.7},
        "model": {"servedModelName": ["a/b", "b"]},
    },
    # TLS everywhere from cert-manager with the release's own CA, attention shards,
    # a restricted OpenAI port.
    "tls-certmanager-karpenter": {
        "tls": {"enabled": True, "certManager": {"enabled": True}, "api": {"dnsNames": ["llm.example.com"]}},
        "attentionWorkers": {"replicas": 2},
        "scheduling": {"instanceFamilyLabel": "karpenter.k8s.aws/instance-family", "nodeAffinity": "preferred", "sameZone": False},
        "metrics": {"serviceMonitor": {"enabled": True}},
        "networkPolicy": {
            "api": {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "apps"}}}]},
            "admin": {"from": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]},
        },
    },
    # cert-manager with a ClusterIssuer, a separate API certificate Secret, one etcd member
    # (RSA keys), no NetworkPolicy.
    "tls-clusterissuer-api-secret": {
        "tls": {
            "enabled": True,
            "certManager": {"enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"},
                            "privateKeyAlgorithm": "RSA", "privateKeySize": 3072},
            "api": {"existingSecret": "public-api-cert"},
        },
        "etcd": {"replicas": 1, "persistence": {"enabled": False}},
        "networkPolicy": {"enabled": False},
        "tests": {"enabled": False},
    },
    # TLS on the node links only (HTTPS terminated by a load balancer), one Secret for all.
    "existing-secrets-no-auth": {
        "auth": {"apiKey": {"enabled": False}, "adminToken": {"existingSecret": "ops-admin"}},
        "tls": {"enabled": True, "existingSecret": "ops-tls", "api": {"enabled": False}},
        "serviceAccount": {"create": False, "name": "epserve-sa"},
        "scheduling": {"nodeAffinity": "none", "tolerations": [{"key": "graviton", "operator": "Exists", "effect": "NoSchedule"}]},
        "coordinator": {"service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]}},
        "networkPolicy": {"metrics": {"from": []}},
    },
    # A Secret per role, attention shards, an external etcd with TLS and user auth.
    "tls-per-role-secrets-external-etcd": {
        "tls": {"enabled": True, "existingSecrets": {
            "coordinator": "coord-tls", "expertWorker": "ew-tls", "attentionWorker": "aw-tls", "client": "ctl-tls"}},
        "attentionWorkers": {"replicas": 4},
        "etcd": {"enabled": False, "external": {
            "endpoints": ["https://etcd-a.infra:2379", "https://etcd-b.infra:2379"],
            "tls": {"existingSecret": "infra-etcd-client"},
            "auth": {"user": "epserve", "existingSecret": "infra-etcd-password"}}},
    },
    # An external etcd with a CA only (no client certificate) and no TLS elsewhere.
    "external-etcd-ca-only": {
        "etcd": {"enabled": False, "external": {
            "endpoints": ["https://etcd.infra:2379"], "tls": {"existingSecret": "infra-etcd-ca", "clientCert": False}}},
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


def pod_spec(obj):
    return obj["spec"] if obj["kind"] == "Pod" else obj["spec"]["template"]["spec"]


def pod_labels(obj):
    return obj["metadata"]["labels"] if obj["kind"] == "Pod" else obj["spec"]["template"]["metadata"]["labels"]


def containers(workload, init=False):
    spec = pod_spec(workload)
    out = list(spec.get("containers", []))
    if init:
        out += spec.get("initContainers", [])
    return out


def pod_owners(objs):
    """Everything that makes pods: Deployments, StatefulSets and bare Pods (the helm test)."""
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet", "Pod")]


def epserve_containers(objs):
    """(pod owner, container) for every container, init ones too, running the epserve image."""
    out = []
    for w in pod_owners(objs):
        for c in containers(w, init=True):
            if c["image"].split("@")[0].rsplit(":", 1)[0].endswith("/epserve"):
                out.append((w, c))
    return out


def secret_volume(workload, volume_name):
    for v in pod_spec(workload).get("volumes", []):
        if v["name"] == volume_name:
            return v["secret"]["secretName"]
    raise AssertionError(f"{workload['metadata']['name']} has no volume {volume_name}")


def mount_path(container, volume_name):
    for m in container.get("volumeMounts", []):
        if m["name"] == volume_name:
            assert m.get("readOnly") is True, f"{container['name']}: {volume_name} mounted writable"
            return m["mountPath"]
    raise AssertionError(f"{container['name']} does not mount {volume_name}")


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
        if data["apiVersion"].startswith("cert-manager.io/"):
            check_cert_manager_shape(data)
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


def check_cert_manager_shape(obj: dict):
    """cert-manager's CRDs are not in the bundled schemas: check the fields we use (cert-manager.io/v1)."""
    assert obj["apiVersion"] == "cert-manager.io/v1", obj["apiVersion"]
    spec = obj["spec"]
    if obj["kind"] == "Issuer":
        assert set(spec) in ({"selfSigned"}, {"ca"}), spec
        if "ca" in spec:
            assert set(spec["ca"]) == {"secretName"}
        return
    assert obj["kind"] == "Certificate", obj["kind"]
    allowed = {"secretName", "secretTemplate", "duration", "renewBefore", "commonName", "dnsNames",
               "ipAddresses", "usages", "privateKey", "issuerRef", "isCA"}
    assert set(spec) <= allowed, set(spec) - allowed
    assert spec["secretName"] and spec["issuerRef"]["name"]
    assert spec["issuerRef"]["kind"] in ("Issuer", "ClusterIssuer")
    assert spec.get("commonName") or spec.get("dnsNames") or spec.get("ipAddresses")
    assert len(spec.get("commonName", "")) <= 64, "cert-manager refuses a commonName over 64 characters"
    for d in ("duration", "renewBefore"):
        if d in spec:
            assert re.fullmatch(r"\d+h", spec[d]), spec[d]
    known_usages = {"digital signature", "key encipherment", "server auth", "client auth", "cert sign"}
    assert set(spec.get("usages", [])) <= known_usages, spec.get("usages")
    pk = spec["privateKey"]
    assert pk["algorithm"] in ("ECDSA", "RSA", "Ed25519") and pk.get("rotationPolicy") == "Always"
    assert set(pk) <= {"algorithm", "size", "rotationPolicy"}


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
        # (values.schema.json refuses these before the templates' own check runs)
        ({"expertWorkers": {"resources": {"cpu": 7.5, "memory": "8Gi"}}}, "/expertWorkers/resources/cpu"),
        ({"expertWorkers": {"resources": {"cpu": "500m", "memory": "8Gi"}}}, "/expertWorkers/resources/cpu"),
        ({"model": {"source": "nfs"}}, "'/model/source': value must be one of"),
        ({"etcd": {"enabled": False}}, "etcd.external.endpoints"),
        ({"etcd": {"replicas": 2}}, "'/etcd/replicas': value must be one of 1, 3, 5"),
        ({"tls": {"enabled": True}}, "tls.enabled needs certificates"),
        ({"tls": {"enabled": True, "existingSecrets": {"coordinator": "c"}}}, "tls.enabled needs certificates"),
        ({"tls": {"enabled": True, "existingSecrets": {"coordinator": "c", "client": "c"}}}, "tls.existingSecrets.expertWorker"),
        ({"tls": {"enabled": True, "cert": "PEM"}}, "tls.cert was removed"),
        ({"metrics": {"workerPort": 9090}}, "metrics.workerPort was removed"),
        ({"tls": {"enabled": True, "existingSecret": "s"}, "expertWorkers": {"advertise": "podIP"}}, "expertWorkers.advertise must be dns"),
        ({"tls": {"enabled": True, "existingSecret": "s"}, "attentionWorkers": {"replicas": 2, "advertise": "podIP"}},
         "attentionWorkers.advertise must be dns"),
        ({"etcd": {"enabled": False, "external": {"endpoints": ["https://e:2379"], "auth": {"user": "u"}}}},
         "etcd.external.auth.existingSecret"),
        ({"etcd": {"enabled": False, "external": {"endpoints": ["http://e:2379"], "tls": {"existingSecret": "ca"}}}},
         "use https://"),
        ({"model": {"source": "s3"}}, "model.s3.uri"),
        ({"expertWorkers": {"antiAffinity": "always"}}, "'/expertWorkers/antiAffinity': value must be one of"),
        ({"scheduling": {"nodeAffinity": "sometimes"}}, "'/scheduling/nodeAffinity': value must be one of"),
        ({"expertWorkers": {"terminationGracePeriodSeconds": 60}}, "must exceed expertWorkers.drainTimeoutSeconds"),
        ({"coordinator": {"expertBf16Share": 0.7}}, "expertBf16Share needs coordinator.expertPrecisionPolicy: load"),
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
    assert int(one(c, "--min-expert-workers")) == values["coordinator"]["minExpertWorkers"]
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
    strategy = dep["spec"]["strategy"]
    assert strategy["type"] == values["coordinator"]["updateStrategy"]
    if strategy["type"] == "RollingUpdate":
        assert strategy["rollingUpdate"]["maxUnavailable"] == 0
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
        if component == "expert-worker" and values[key].get("expertMemory"):
            assert one(c, "--expert-memory") == values[key]["expertMemory"]


def test_workers_are_ready_by_grpc_health_and_expert_workers_drain_on_sigterm(scenario):
    name, values, objs = scenario
    for component, key in (("expert-worker", "expertWorkers"), ("attention-worker", "attentionWorkers")):
        if values[key]["replicas"] == 0:
            continue
        sts = find(objs, "StatefulSet", fullname(component))
        c = containers(sts)[0]
        # Readiness: Kubernetes' gRPC probe (grpc.health.v1.Health) on the worker's own port;
        # liveness stays TCP (NOT_SERVING while loading or draining must not kill the pod).
        # With mutual TLS the kubelet's gRPC probe (plaintext, no client certificate) cannot
        # pass: readiness is a TCP probe then.
        if values["tls"]["enabled"]:
            assert "grpc" not in c["readinessProbe"], f"{name}: {component}"
            assert c["readinessProbe"]["tcpSocket"]["port"] == "grpc"
        else:
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
        ("expertPrecisionPolicy", "--expert-precision-policy"),
    ):
        if values["coordinator"].get(key):
            assert one(c, flag) == values["coordinator"][key]
        else:
            assert flag not in flags(c)
    share = values["coordinator"].get("expertBf16Share")
    if share is not None:
        assert float(one(c, "--expert-bf16-share")) == share
    else:
        assert "--expert-bf16-share" not in flags(c)


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
    scheme = "https" if values["tls"]["enabled"] else "http"
    assert endpoint == f"{scheme}://{svc['metadata']['name']}.{NAMESPACE}.svc.{DOMAIN}:{client['port']}"
    sts = find(objs, "StatefulSet", fullname("etcd"))
    etcd = containers(sts)[0]
    assert named_port(etcd, "client") == client["port"] or client["targetPort"] == "client"
    assert one(etcd, "--listen-client-urls") == f"{scheme}://0.0.0.0:{named_port(etcd, 'client')}"
    assert one(etcd, "--listen-peer-urls") == f"{scheme}://0.0.0.0:{named_port(etcd, 'peer')}"
    # /metrics, /livez and /readyz stay plain HTTP (the probes use them).
    assert one(etcd, "--listen-metrics-urls") == f"http://0.0.0.0:{named_port(etcd, 'metrics')}"
    # The initial cluster names every member by its peer DNS name.
    replicas = values["etcd"]["replicas"]
    assert sts["spec"]["replicas"] == replicas
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    peers = sts["spec"]["serviceName"]
    peer_port = named_port(etcd, "peer")
    members = one(etcd, "--initial-cluster").split(",")
    assert members == [
        f"{sts['metadata']['name']}-{i}={scheme}://{sts['metadata']['name']}-{i}.{peers}.{NAMESPACE}.svc.{DOMAIN}:{peer_port}"
        for i in range(replicas)
    ]
    assert one(etcd, "--initial-advertise-peer-urls") == f"{scheme}://$(POD_NAME).{peers}.{NAMESPACE}.svc.{DOMAIN}:{peer_port}"
    if values["etcd"]["persistence"]["enabled"]:
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        assert claim["metadata"]["name"] == "data"
        assert claim["spec"]["resources"]["requests"]["storage"] == values["etcd"]["persistence"]["size"]
    else:
        assert "volumeClaimTemplates" not in sts["spec"]


def external_secrets(values) -> set[str]:
    """Secrets the values name that live outside the chart."""
    t, ext = values["tls"], values["etcd"]["external"]
    names = {
        values["auth"]["apiKey"]["existingSecret"],
        values["auth"]["adminToken"]["existingSecret"],
        t["api"]["existingSecret"],
    }
    if not t["certManager"]["enabled"]:
        names |= {t["existingSecret"], *t["existingSecrets"].values()}
    if not values["etcd"]["enabled"]:
        names |= {ext["tls"]["existingSecret"], ext["auth"]["existingSecret"]}
    return names - {""}


def test_referenced_secrets_exist(scenario):
    name, values, objs = scenario
    rendered = {o["metadata"]["name"] for o in by_kind(objs, "Secret")}
    issued = {c["spec"]["secretName"] for c in by_kind(objs, "Certificate")}
    external = external_secrets(values)
    for w in pod_owners(objs):
        spec = pod_spec(w)
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
            if secret in external or secret in issued:
                continue
            assert secret in rendered, f"{name}: {w['metadata']['name']} needs Secret {secret}"
            if key:
                data = find(objs, "Secret", secret)["data"]
                assert key in data, f"{name}: Secret {secret} lacks {key}"
    c = containers(find(objs, "Deployment", fullname("coordinator")))[0]
    env = {e["name"] for e in c["env"]}
    assert "EPSERVE_ADMIN_TOKEN" in env
    assert ("EPSERVE_API_KEY" in env) == values["auth"]["apiKey"]["enabled"]
    # No private key is ever rendered into a chart Secret: TLS material comes from
    # cert-manager or from Secrets made outside the chart.
    for secret in by_kind(objs, "Secret"):
        assert not any(k.endswith(".key") for k in secret.get("data", {})), f"{name}: {secret['metadata']['name']}"


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
        sizes = values[key]["instanceSizes"] or s["instanceSizes"]
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
                assert expr["values"] == [f"{f}.{z}" for f in families for z in sizes]
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


# ---------------------------------------------------------------------------
# TLS, certificates, NetworkPolicy
# ---------------------------------------------------------------------------

TLS_ROLE = {
    fullname("coordinator"): "coordinator",
    fullname("expert-worker"): "expertWorker",
    fullname("attention-worker"): "attentionWorker",
    fullname("etcd"): "etcd",
    fullname("test-ctl"): "client",
}


def expected_tls_secret(values, role) -> str:
    t = values["tls"]
    if t["certManager"]["enabled"]:
        component = {"expertWorker": "expert-worker", "attentionWorker": "attention-worker"}.get(role, role)
        return f"{fullname(component)}-tls"
    return t["existingSecrets"].get(role) or t["existingSecret"]


def test_tls_switch_wires_every_link(scenario):
    """tls.enabled: every epserve container gets its role's certificate mounted and
    --tls-cert/--tls-key/--tls-ca (mutual TLS), the coordinator --api-tls-* with tls.api,
    the roles reach the chart's etcd over https with their certificate, and etcd serves
    TLS with client-cert auth to clients and peers. Off: none of it."""
    name, values, objs = scenario
    t = values["tls"]
    mount = t["mountPath"].rstrip("/")
    tls_flags = {"--tls-cert", "--tls-key", "--tls-ca"}
    for w, c in epserve_containers(objs):
        f = flags(c)
        if not t["enabled"]:
            assert not tls_flags & f.keys() and "--api-tls-cert" not in f, f"{name}: {c['name']}"
            assert "tls" not in {v["name"] for v in pod_spec(w).get("volumes", [])}
            continue
        assert one(c, "--tls-cert") == f"{mount}/tls.crt", f"{name}: {c['name']}"
        assert one(c, "--tls-key") == f"{mount}/tls.key"
        assert one(c, "--tls-ca") == f"{mount}/ca.crt"
        assert mount_path(c, "tls") == t["mountPath"]
        role = TLS_ROLE[w["metadata"]["name"]]
        assert secret_volume(w, "tls") == expected_tls_secret(values, role), f"{name}: {w['metadata']['name']}"
        if role == "coordinator" and t["api"]["enabled"]:
            api = mount_path(c, "api-tls")
            assert one(c, "--api-tls-cert") == f"{api}/tls.crt" and one(c, "--api-tls-key") == f"{api}/tls.key"
            want = t["api"]["existingSecret"] or (
                f"{fullname('coordinator')}-api-tls" if t["certManager"]["enabled"] else expected_tls_secret(values, role)
            )
            assert secret_volume(w, "api-tls") == want
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "httpGet" in c[probe]:
                    assert c[probe]["httpGet"]["scheme"] == "HTTPS", f"{name}: {probe}"
        else:
            assert "--api-tls-cert" not in f and "--api-tls-key" not in f
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "httpGet" in c.get(probe, {}):
                    assert c[probe]["httpGet"].get("scheme", "HTTP") == "HTTP"
        # The kubelet's gRPC probe has no client certificate: no gRPC probe on an mTLS port.
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in c.get(probe, {}), f"{name}: {c['name']} {probe}"
        if c["args"][0] != "ctl" and values["etcd"]["enabled"]:
            assert one(c, "--etcd").startswith("https://")
            assert one(c, "--etcd-ca") == f"{mount}/ca.crt"
            assert one(c, "--etcd-cert") == f"{mount}/tls.crt" and one(c, "--etcd-key") == f"{mount}/tls.key"
    if not values["etcd"]["enabled"]:
        return
    sts = find(objs, "StatefulSet", fullname("etcd"))
    etcd = containers(sts)[0]
    f = flags(etcd)
    server = {"--cert-file", "--key-file", "--trusted-ca-file", "--client-cert-auth",
              "--peer-cert-file", "--peer-key-file", "--peer-trusted-ca-file", "--peer-client-cert-auth"}
    if not t["enabled"]:
        assert not server & f.keys()
        return
    assert server <= f.keys(), f"{name}: etcd lacks {server - f.keys()}"
    certs = mount_path(etcd, "tls")
    assert one(etcd, "--cert-file") == one(etcd, "--peer-cert-file") == f"{certs}/tls.crt"
    assert one(etcd, "--key-file") == one(etcd, "--peer-key-file") == f"{certs}/tls.key"
    assert one(etcd, "--trusted-ca-file") == one(etcd, "--peer-trusted-ca-file") == f"{certs}/ca.crt"
    assert f["--client-cert-auth"] == [""] and f["--peer-client-cert-auth"] == [""]
    assert secret_volume(sts, "tls") == expected_tls_secret(values, "etcd")
    for url_flag in ("--listen-client-urls", "--advertise-client-urls", "--listen-peer-urls", "--initial-advertise-peer-urls"):
        assert one(etcd, url_flag).startswith("https://"), url_flag
    # Probes stay on the plain-HTTP metrics port, which needs no client certificate.
    for probe in ("readinessProbe", "livenessProbe"):
        assert etcd[probe]["httpGet"]["port"] == "metrics" and etcd[probe]["httpGet"].get("scheme", "HTTP") == "HTTP"


def test_external_etcd_security(scenario):
    name, values, objs = scenario
    if values["etcd"]["enabled"]:
        return
    ext = values["etcd"]["external"]
    for w, c in epserve_containers(objs):
        f = flags(c)
        if c["args"][0] == "ctl":
            assert not [k for k in f if k.startswith("--etcd")], f"{name}: ctl needs no etcd"
            continue
        if ext["tls"]["existingSecret"]:
            d = mount_path(c, "etcd-tls")
            assert secret_volume(w, "etcd-tls") == ext["tls"]["existingSecret"]
            assert one(c, "--etcd-ca") == f"{d}/ca.crt"
            if ext["tls"]["clientCert"]:
                assert one(c, "--etcd-cert") == f"{d}/tls.crt" and one(c, "--etcd-key") == f"{d}/tls.key"
            else:
                assert "--etcd-cert" not in f and "--etcd-key" not in f
        else:
            assert "--etcd-ca" not in f
        if ext["auth"]["user"]:
            assert one(c, "--etcd-user") == ext["auth"]["user"]
            d = mount_path(c, "etcd-auth")
            assert one(c, "--etcd-password-file") == f"{d}/password"
            (vol,) = [v for v in pod_spec(w)["volumes"] if v["name"] == "etcd-auth"]
            assert vol["secret"]["secretName"] == ext["auth"]["existingSecret"]
            assert vol["secret"]["items"] == [{"key": ext["auth"]["secretKey"], "path": "password"}]
        else:
            assert "--etcd-user" not in f and "--etcd-password-file" not in f
        # The password never travels on the command line or in the pod spec.
        assert not [e for e in c.get("env", []) if e["name"] == "EPSERVE_ETCD_PASSWORD"]


def san_matches(pattern: str, host: str) -> bool:
    """RFC 6125 matching as rustls/webpki does it: a wildcard covers one leftmost label."""
    if pattern.startswith("*."):
        head, _, rest = host.partition(".")
        return bool(head) and rest == pattern[2:]
    return pattern == host


def certificate_for(objs, secret):
    certs = [c for c in by_kind(objs, "Certificate") if c["spec"]["secretName"] == secret]
    assert len(certs) == 1, f"Secret {secret}: {len(certs)} Certificates"
    return certs[0]["spec"]


def host_of(url: str) -> str:
    return re.sub(r"^[a-z]+://", "", url).rsplit(":", 1)[0]


def test_certificates_name_the_addresses_peers_dial(scenario):
    """cert-manager: each role's Certificate carries the names its peers dial: every
    worker pod's advertised address (what it registers in etcd and the coordinator
    checks the certificate against), the admin Service `epserve ctl` dials, etcd's
    client Service and every member's peer and client URL; usages fit the role."""
    name, values, objs = scenario
    t = values["tls"]
    if not (t["enabled"] and t["certManager"]["enabled"]):
        assert not by_kind(objs, "Certificate") and not by_kind(objs, "Issuer"), name
        return
    for component, key in (("expert-worker", "expertWorkers"), ("attention-worker", "attentionWorkers")):
        if values[key]["replicas"] == 0:
            continue
        sts = find(objs, "StatefulSet", fullname(component))
        spec = certificate_for(objs, secret_volume(sts, "tls"))
        assert {"server auth", "client auth"} <= set(spec["usages"])
        advertise = host_of(one(containers(sts)[0], "--advertise"))
        for i in range(values[key]["replicas"]):
            host = advertise.replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}")
            assert "$(" not in host
            assert any(san_matches(p, host) for p in spec["dnsNames"]), f"{name}: {host} not in {spec['dnsNames']}"
        # A worker's certificate names only its own StatefulSet's pods.
        assert not any(san_matches(p, f"{fullname('coordinator')}.{NAMESPACE}.svc.{DOMAIN}") for p in spec["dnsNames"])
    dep = find(objs, "Deployment", fullname("coordinator"))
    spec = certificate_for(objs, secret_volume(dep, "tls"))
    assert {"server auth", "client auth"} <= set(spec["usages"])
    for pod in by_kind(objs, "Pod"):
        (c,) = containers(pod)
        admin = host_of(one(c, "--admin"))
        assert admin in spec["dnsNames"], f"{name}: ctl dials {admin}"
        client = certificate_for(objs, secret_volume(pod, "tls"))
        assert "client auth" in client["usages"] and "server auth" not in client["usages"]
    assert f"{fullname('coordinator')}-admin.{NAMESPACE}.svc.{DOMAIN}" in spec["dnsNames"]
    assert "localhost" in spec["dnsNames"] and "127.0.0.1" in spec["ipAddresses"]  # kubectl port-forward
    if t["api"]["enabled"]:
        api = secret_volume(dep, "api-tls")
        if t["api"]["existingSecret"]:
            assert api == t["api"]["existingSecret"]
            assert not [c for c in by_kind(objs, "Certificate") if c["spec"]["secretName"] == api]
        else:
            a = certificate_for(objs, api)
            assert f"{fullname('coordinator')}.{NAMESPACE}.svc.{DOMAIN}" in a["dnsNames"]
            assert set(t["api"]["dnsNames"]) <= set(a["dnsNames"])
            assert a["usages"] == ["digital signature", "server auth"]
    if values["etcd"]["enabled"]:
        sts = find(objs, "StatefulSet", fullname("etcd"))
        etcd = containers(sts)[0]
        spec = certificate_for(objs, secret_volume(sts, "tls"))
        assert {"server auth", "client auth"} <= set(spec["usages"])  # peers are clients too
        hosts = {host_of(one(c, "--etcd")) for _, c in epserve_containers(objs) if c["args"][0] != "ctl"}
        hosts |= {host_of(m.split("=", 1)[1]) for m in one(etcd, "--initial-cluster").split(",")}
        for i in range(values["etcd"]["replicas"]):
            hosts.add(host_of(one(etcd, "--advertise-client-urls").replace("$(POD_NAME)", f"{sts['metadata']['name']}-{i}")))
        for host in hosts:
            assert any(san_matches(p, host) for p in spec["dnsNames"]), f"{name}: etcd {host} not in {spec['dnsNames']}"
    # Issuers: the release's own CA chain, or the configured issuer.
    ref = t["certManager"]["issuerRef"]
    issuers = {i["metadata"]["name"]: i["spec"] for i in by_kind(objs, "Issuer")}
    for cert in by_kind(objs, "Certificate"):
        r = cert["spec"]["issuerRef"]
        if cert["metadata"]["name"] == f"{fullname()}-api-tls" and t["api"]["issuerRef"]["name"]:
            assert r["name"] == t["api"]["issuerRef"]["name"]
        elif ref["name"]:
            assert (r["name"], r["kind"]) == (ref["name"], ref["kind"]), cert["metadata"]["name"]
        else:
            assert r["kind"] == "Issuer" and r["name"] in issuers, cert["metadata"]["name"]
    if ref["name"]:
        assert not issuers
    else:
        ca = find(objs, "Certificate", f"{fullname()}-ca")["spec"]
        assert ca["isCA"] is True and issuers[ca["issuerRef"]["name"]] == {"selfSigned": {}}
        assert issuers[f"{fullname()}-ca"] == {"ca": {"secretName": ca["secretName"]}}
        for cert in by_kind(objs, "Certificate"):
            if cert["metadata"]["name"] != f"{fullname()}-ca":
                assert cert["spec"]["issuerRef"]["name"] == f"{fullname()}-ca"


def peer_selects(peer: dict, labels: dict, same_namespace=True) -> bool:
    """Whether a NetworkPolicyPeer (podSelector only, same namespace) selects a pod."""
    if set(peer) != {"podSelector"} or not same_namespace:
        return False
    sel = peer["podSelector"]
    if not sel.get("matchLabels", {}).items() <= labels.items():
        return False
    for e in sel.get("matchExpressions", []):
        assert e["operator"] == "In"
        if labels.get(e["key"]) not in e["values"]:
            return False
    return True


def allowed(policy: dict, port: str, labels: dict) -> bool:
    for rule in policy["spec"].get("ingress", []):
        if not any(p["port"] == port for p in rule.get("ports", [])):
            continue
        if "from" not in rule or any(peer_selects(p, labels) for p in rule["from"]):
            return True
    return False


def test_network_policies(scenario):
    """Only the coordinator reaches the workers' gRPC ports; only the release's epserve
    pods reach etcd's client port and only members its peer port; the OpenAI port is
    open to networkPolicy.api.from (anyone when empty); metrics from networkPolicy.metrics.from."""
    name, values, objs = scenario
    np = values["networkPolicy"]
    policies = by_kind(objs, "NetworkPolicy")
    if not np["enabled"]:
        assert not policies, name
        return
    pods = {pod_labels(w)["app.kubernetes.io/component"]: (w, pod_labels(w)) for w in pod_owners(objs)}
    # A pod of another release, or of another app, in the same namespace.
    strangers = [
        {**pods["coordinator"][1], "app.kubernetes.io/instance": "other"},
        {"app": "debug"},
    ]
    for p in policies:
        assert p["spec"]["policyTypes"] == ["Ingress"]
        selected = [c for c, (_, lab) in pods.items() if p["spec"]["podSelector"]["matchLabels"].items() <= lab.items()]
        assert len(selected) == 1, f"{name}: {p['metadata']['name']} selects {selected}"
        (component,) = selected
        w, _ = pods[component]
        names = {port["name"] for c in containers(w) for port in c.get("ports", [])}
        for rule in p["spec"]["ingress"]:
            for port in rule["ports"]:
                assert port["port"] in names, f"{name}: {p['metadata']['name']} port {port['port']}"
    by_component = {
        c: [p for p in policies if p["spec"]["podSelector"]["matchLabels"].items() <= lab.items()]
        for c, (_, lab) in pods.items()
    }
    for component in ("coordinator", "expert-worker", "attention-worker", "etcd"):
        if component in pods:
            assert len(by_component[component]) == 1, f"{name}: {component} has {len(by_component[component])} policies"
    assert not by_component.get("ctl"), "the test pod needs no ingress"
    for component in ("expert-worker", "attention-worker"):
        if component not in pods:
            continue
        (p,) = by_component[component]
        for other, (_, lab) in pods.items():
            assert allowed(p, "grpc", lab) == (other == "coordinator"), f"{name}: {other} -> {component}"
        assert not any(allowed(p, "grpc", lab) for lab in strangers)
    (coord,) = by_component["coordinator"]
    http_rules = [r for r in coord["spec"]["ingress"] if any(pt["port"] == "http" for pt in r["ports"])]
    if np["api"]["from"]:
        assert not any(allowed(coord, "http", lab) for lab in strangers)
        (rule,) = http_rules
        assert rule["from"] == np["api"]["from"] + np["metrics"]["from"]
    else:
        assert allowed(coord, "http", strangers[1])
    assert allowed(coord, "admin", pods["ctl"][1]) if "ctl" in pods else True
    for other in ("expert-worker", "attention-worker", "etcd"):
        if other in pods:
            assert not allowed(coord, "admin", pods[other][1]), f"{name}: {other} -> admin"
    assert not any(allowed(coord, "admin", lab) for lab in strangers)
    if values["etcd"]["enabled"]:
        (p,) = by_component["etcd"]
        for other, (_, lab) in pods.items():
            assert allowed(p, "client", lab) == (other in ("coordinator", "expert-worker", "attention-worker")), (
                f"{name}: {other} -> etcd client"
            )
            assert allowed(p, "peer", lab) == (other == "etcd"), f"{name}: {other} -> etcd peer"
        assert not any(allowed(p, port, lab) for lab in strangers for port in ("client", "peer", "metrics"))
        metrics = [r for r in p["spec"]["ingress"] if any(pt["port"] == "metrics" for pt in r["ports"])]
        if np["metrics"]["from"]:
            (rule,) = metrics
            assert rule["from"] == np["metrics"]["from"]
        else:
            assert not metrics


def openssl_cert(tmp: Path, name: str, ca: tuple[Path, Path] | None, spec: dict) -> tuple[Path, Path]:
    """A certificate as cert-manager would issue it from a Certificate spec (SANs,
    usages), signed by `ca`, or a CA itself when ca is None. Returns (cert, key)."""
    key, cert = tmp / f"{name}.key", tmp / f"{name}.crt"
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True, timeout=60)  # noqa: E731
    run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", str(key))
    if ca is None:
        run("req", "-x509", "-new", "-key", str(key), "-subj", f"/CN={name}", "-days", "2", "-out", str(cert),
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        return cert, key
    csr = tmp / f"{name}.csr"
    run("req", "-new", "-key", str(key), "-subj", f"/CN={spec.get('commonName', name)}", "-out", str(csr))
    eku = {"server auth": "serverAuth", "client auth": "clientAuth"}
    ext = ["keyUsage=critical,digitalSignature",
           "extendedKeyUsage=" + ",".join(eku[u] for u in spec["usages"] if u in eku)]
    sans = [f"DNS:{d}" for d in spec.get("dnsNames", [])] + [f"IP:{i}" for i in spec.get("ipAddresses", [])]
    if sans:
        ext.append("subjectAltName=" + ",".join(sans))
    (tmp / f"{name}.ext").write_text("\n".join(ext) + "\n")
    run("x509", "-req", "-in", str(csr), "-CA", str(ca[0]), "-CAkey", str(ca[1]), "-CAcreateserial",
        "-days", "2", "-out", str(cert), "-extfile", str(tmp / f"{name}.ext"))
    return cert, key


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_chart_etcd_tls_flags_work_with_a_real_etcd(tmp_path):
    """The chart's etcd, TLS on: a real etcd (on PATH) started with exactly the flags the
    chart renders (addresses moved to loopback, files to a temp folder), certificates
    made as cert-manager would from the rendered Certificates. The probes' plain-HTTP
    /readyz answers; an epserve role's certificate (the expert-workers') is accepted;
    no client certificate, or one from another CA, is refused. (etcd also refuses a
    client without a certificate once --trusted-ca-file is set, so this cannot tell
    whether --client-cert-auth is there: test_tls_switch_wires_every_link checks it.)"""
    import time
    import urllib.request

    etcd, etcdctl = shutil.which("etcd"), shutil.which("etcdctl")
    if not (etcd and etcdctl and shutil.which("openssl")):
        pytest.skip("needs etcd, etcdctl and openssl on PATH")
    values = {"tls": {"enabled": True, "certManager": {"enabled": True}}, "etcd": {"replicas": 1, "persistence": {"enabled": False}}}
    objs = render(values)
    sts = find(objs, "StatefulSet", fullname("etcd"))
    c = containers(sts)[0]
    certs_dir = mount_path(c, "tls")
    ca = openssl_cert(tmp_path, "ca", None, {})
    other_ca = openssl_cert(tmp_path, "other-ca", None, {})
    etcd_cert = openssl_cert(tmp_path, "etcd", ca, certificate_for(objs, secret_volume(sts, "tls")))
    worker_spec = certificate_for(objs, secret_volume(find(objs, "StatefulSet", fullname("expert-worker")), "tls"))
    worker = openssl_cert(tmp_path, "worker", ca, worker_spec)
    stranger = openssl_cert(tmp_path, "stranger", other_ca, worker_spec)
    tls_dir = tmp_path / "etcd-tls"
    tls_dir.mkdir()
    for src, dst in ((etcd_cert[0], "tls.crt"), (etcd_cert[1], "tls.key"), (ca[0], "ca.crt")):
        (tls_dir / dst).write_bytes(src.read_bytes())
    client_port, peer_port, metrics_port = free_port(), free_port(), free_port()
    member = f"{sts['metadata']['name']}-0"
    loopback = {
        "--name": member,
        "--data-dir": str(tmp_path / "data"),
        "--listen-client-urls": f"https://127.0.0.1:{client_port}",
        "--advertise-client-urls": f"https://127.0.0.1:{client_port}",
        "--listen-peer-urls": f"https://127.0.0.1:{peer_port}",
        "--initial-advertise-peer-urls": f"https://127.0.0.1:{peer_port}",
        "--initial-cluster": f"{member}=https://127.0.0.1:{peer_port}",
        "--listen-metrics-urls": f"http://127.0.0.1:{metrics_port}",
    }
    args = []
    for arg in c["args"]:
        flag, eq, value = arg.partition("=")
        if flag in loopback:
            value = loopback[flag]
        value = value.replace(certs_dir, str(tls_dir))
        args.append(f"{flag}{eq}{value}")
    assert {a.partition("=")[0] for a in args} == set(flags(c)), "the chart's flag set is kept"
    log = open(tmp_path / "etcd.log", "w")
    proc = subprocess.Popen([etcd, *args], stdout=subprocess.DEVNULL, stderr=log)
    try:
        port = named_port(c, "metrics")
        assert c["readinessProbe"]["httpGet"]["port"] == "metrics" and port
        path = c["readinessProbe"]["httpGet"]["path"]
        version = subprocess.run([etcd, "--version"], capture_output=True, text=True, timeout=30).stdout
        if re.search(r"Version: 3\.4\.", version):
            path = "/health"  # /readyz and /livez (the chart's image is 3.5) came with etcd 3.5
        for _ in range(100):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}{path}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        else:
            pytest.fail("etcd never turned ready:\n" + (tmp_path / "etcd.log").read_text()[-3000:])
        assert proc.poll() is None, (tmp_path / "etcd.log").read_text()[-3000:]

        def ctl(*extra):
            return subprocess.run(
                [etcdctl, f"--endpoints=https://127.0.0.1:{client_port}", "--dial-timeout=3s", "--command-timeout=5s",
                 f"--cacert={ca[0]}", *extra, "put", "/epserve/ep/probe", "x"],
                capture_output=True, text=True, timeout=30, env={**os.environ, "ETCDCTL_API": "3"},
            )

        ok = ctl(f"--cert={worker[0]}", f"--key={worker[1]}")
        assert ok.returncode == 0, ok.stderr
        assert ctl().returncode != 0, "etcd let in a client without a certificate"
        assert ctl(f"--cert={stranger[0]}", f"--key={stranger[1]}").returncode != 0, "etcd let in another CA's certificate"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def test_metrics_scraping(scenario):
    """Only what really serves /metrics is scraped: the coordinator on its OpenAI port
    (HTTPS with TLS on), etcd on its metrics port; the workers serve none."""
    name, values, objs = scenario
    https = values["tls"]["enabled"] and values["tls"]["api"]["enabled"]
    dep = find(objs, "Deployment", fullname("coordinator"))
    ann = dep["spec"]["template"]["metadata"].get("annotations", {})
    if values["metrics"]["podAnnotations"]:
        assert ann["prometheus.io/scrape"] == "true"
        assert ann["prometheus.io/port"] == str(named_port(containers(dep)[0], "http"))
        assert ann.get("prometheus.io/scheme", "http") == ("https" if https else "http")
    for component in ("expert-worker", "attention-worker"):
        for sts in [o for o in by_kind(objs, "StatefulSet") if o["metadata"]["name"] == fullname(component)]:
            assert "prometheus.io/scrape" not in sts["spec"]["template"]["metadata"].get("annotations", {})
            assert [p["name"] for p in containers(sts)[0]["ports"]] == ["grpc"], f"{name}: {component} ports"
            svc = find(objs, "Service", sts["spec"]["serviceName"])
            assert [p["name"] for p in svc["spec"]["ports"]] == ["grpc"]
    monitors = by_kind(objs, "ServiceMonitor")
    if not values["metrics"]["serviceMonitor"]["enabled"]:
        assert not monitors
        return
    expected = {fullname("coordinator")} | ({fullname("etcd")} if values["etcd"]["enabled"] else set())
    assert {m["metadata"]["name"] for m in monitors} == expected, f"{name}: {[m['metadata']['name'] for m in monitors]}"
    for sm in monitors:
        sel = sm["spec"]["selector"]["matchLabels"]
        ep = sm["spec"]["endpoints"][0]
        port = ep["port"]
        svcs = [
            s for s in by_kind(objs, "Service")
            if sel.items() <= s["metadata"]["labels"].items() and any(p["name"] == port for p in s["spec"]["ports"])
        ]
        assert svcs, f"{name}: ServiceMonitor {sm['metadata']['name']} finds no Service with port {port}"
        is_coordinator = sm["metadata"]["name"] == fullname("coordinator")
        assert ep.get("scheme", "http") == ("https" if https and is_coordinator else "http")
        for k, v in values["metrics"]["serviceMonitor"]["labels"].items():
            assert sm["metadata"]["labels"][k] == v


# ---------------------------------------------------------------------------
# The epserve binary: flags and plan
# ---------------------------------------------------------------------------

# Flags the chart may render before the binary has them (a chart change landing
# ahead of its Rust side): tolerated while the binary lacks them, and only them; once
# the binary accepts one for every role that renders it, the test fails until it is
# taken out of this set. Empty: every rendered flag must be the binary's.
PENDING_FLAGS: set[str] = set()


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


_HELP_CACHE: dict[tuple, set[str] | None] = {}


def help_flags(binary: Path, role: str | list[str]) -> set[str] | None:
    """The long options `epserve <role...> --help` lists (only its option lines, not
    flags mentioned in descriptions); None when the subcommand is not in this build."""
    words = [role] if isinstance(role, str) else list(role)
    key = (str(binary), *words)
    if key in _HELP_CACHE:
        return _HELP_CACHE[key]
    parent = subprocess.run([str(binary), *words[:-1], "--help"], capture_output=True, text=True, timeout=60)
    if not re.search(rf"^\s+{re.escape(words[-1])}\s", parent.stdout, re.M):
        _HELP_CACHE[key] = None
        return None
    out = subprocess.run([str(binary), *words, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    found = set(re.findall(r"^\s+(?:-\w,\s+)?(--[a-z0-9][a-z0-9-]*)", out.stdout, re.M))
    _HELP_CACHE[key] = found
    return found


def command_words(container) -> list[tuple[list[str], str]]:
    """(subcommand path, flag) for every --flag of an epserve container: flags before a
    nested subcommand (ctl's `workers`) belong to the parent, after it to the child."""
    args = container["args"]
    path = [args[0]]
    out = []
    for arg in args[1:]:
        if arg.startswith("--"):
            out.append((list(path), arg.partition("=")[0]))
        elif re.fullmatch(r"[a-z][a-z-]*", arg):
            path.append(arg)
        else:
            raise AssertionError(f"{container['name']}: positional argument {arg!r}: write flags as --flag=value")
    return out


def test_every_epserve_container_runs_a_known_role(scenario):
    name, _, objs = scenario
    roles = {c["args"][0] for _, c in epserve_containers(objs)}
    assert roles <= {"coordinator", "expert-worker", "attention-worker", "ctl"}, f"{name}: {roles}"
    assert {"coordinator", "expert-worker"} <= roles


def test_chart_flags_exist_in_the_binary():
    """Strict: every flag of every epserve container (each role, init containers, the helm
    test pod) in every scenario is accepted by `epserve <role> --help`. The only exception
    is PENDING_FLAGS, while the binary lacks them."""
    binary = epserve_binary()
    if binary is None:
        pytest.skip("no epserve binary built (cargo build --bin epserve, or set EPSERVE_BIN)")
    unknown: dict[str, set[str]] = {}
    pending_missing: dict[str, set[str]] = {}
    pending_rendered: dict[str, set[str]] = {}
    checked = set()
    for name, values in SCENARIOS.items():
        for w, c in epserve_containers(render(values)):
            path = [c["args"][0]] + [a for a in c["args"][1:] if not a.startswith("--")]
            assert help_flags(binary, path) is not None, f"{name}: `epserve {' '.join(path)}` is not in this build"
            checked.add(" ".join(path))
            for path, flag in command_words(c):
                cmd = " ".join(path)
                known = help_flags(binary, path)
                assert known is not None, f"{name}: {w['metadata']['name']} runs `epserve {cmd}`, which this build lacks"
                checked.add(cmd)
                if flag in PENDING_FLAGS:
                    pending_rendered.setdefault(flag, set()).add(cmd)
                if flag in known:
                    continue
                if flag in PENDING_FLAGS:
                    pending_missing.setdefault(cmd, set()).add(flag)
                else:
                    unknown.setdefault(cmd, set()).add(f"{flag} ({name})")
    assert not unknown, "flags the binary does not accept (deploy/helm/epserve/templates/_args.tpl):\n" + "\n".join(
        f"  epserve {cmd}: {sorted(f)}" for cmd, f in sorted(unknown.items())
    )
    landed = sorted(f for f, cmds in pending_rendered.items() if not any(f in pending_missing.get(c, ()) for c in cmds))
    assert not landed, f"{binary} accepts {landed} now: take them out of PENDING_FLAGS"
    assert {"coordinator", "expert-worker", "attention-worker", "ctl workers"} <= checked, checked


def test_etcd_flags_exist_in_etcd():
    """The chart's etcd flags, against the `etcd --help` of an etcd on PATH (3.4+)."""
    etcd = shutil.which("etcd")
    if etcd is None:
        pytest.skip("no etcd on PATH")
    out = subprocess.run([etcd, "--help"], capture_output=True, text=True, timeout=60)
    known = set(re.findall(r"^\s+(--[a-z0-9][a-z0-9-]*)", out.stdout + out.stderr, re.M))
    assert "--listen-client-urls" in known, out.stdout[:500]
    unknown = set()
    for name, values in SCENARIOS.items():
        for w in by_kind(render(values), "StatefulSet"):
            if w["metadata"]["name"] != fullname("etcd"):
                continue
            for flag in flags(containers(w)[0]):
                if flag not in known:
                    unknown.add(f"{flag} ({name})")
    assert not unknown, sorted(unknown)


QWEN3_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False, "hidden_act": "silu",
    "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16",
}


_NODE_MODEL: list[dict | None] = []


def node_model() -> dict | None:
    """`epserve plan --node-model`: allocatable CPU / memory per instance type and the
    DaemonSets' requests (one model for the planner and this test)."""
    if not _NODE_MODEL:
        binary = epserve_binary()
        model = None
        if binary is not None and "--node-model" in (help_flags(binary, "plan") or set()):
            run = subprocess.run([str(binary), "plan", "--node-model"], capture_output=True, text=True, timeout=60)
            assert run.returncode == 0, run.stderr
            model = json.loads(run.stdout)
        _NODE_MODEL.append(model)
    return _NODE_MODEL[0]


def cpu_millis(q) -> int:
    q = str(q)
    return int(q[:-1]) if q.endswith("m") else int(float(q) * 1000)


def memory_mib(q) -> float:
    q = str(q)
    units = {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024, "Ti": 1024 * 1024, "k": 1e3 / 2**20, "M": 1e6 / 2**20, "G": 1e9 / 2**20}
    for u, f in units.items():
        if q.endswith(u):
            return float(q[: -len(u)]) * f
    return float(q) / 2**20


def pod_requests(workload) -> tuple[int, float]:
    """What the scheduler counts for one pod: the larger of the containers' sum and
    the largest init container (Kubernetes' effective request)."""
    def req(c):
        r = c.get("resources", {})
        got = r.get("requests") or r.get("limits") or {}
        return cpu_millis(got.get("cpu", 0)), memory_mib(got.get("memory", 0))
    main = [req(c) for c in containers(workload)]
    init = [req(c) for c in containers(workload, init=True) if c not in containers(workload)]
    cpu = max([sum(c for c, _ in main)] + [c for c, _ in init])
    mem = max([sum(m for _, m in main)] + [m for _, m in init])
    return cpu, mem


def offered_instance_types(workload) -> list[str]:
    """The node.kubernetes.io/instance-type values a workload's required node affinity
    allows (empty: no instance-type constraint)."""
    na = workload["spec"]["template"]["spec"].get("affinity", {}).get("nodeAffinity", {})
    req = na.get("requiredDuringSchedulingIgnoredDuringExecution", {})
    types = []
    for term in req.get("nodeSelectorTerms", []):
        for expr in term.get("matchExpressions", []):
            if expr["key"] == "node.kubernetes.io/instance-type":
                types += expr["values"]
    return types


def test_pods_fit_the_allocatable_of_every_offered_instance_type(scenario):
    name, values, objs = scenario
    model = node_model()
    if model is None:
        pytest.skip("no epserve binary with `plan --node-model` built")
    nodes = {i["name"]: i for i in model["instances"]}
    ds_cpu = model["assumptions"]["daemonset_cpu_millis"]
    ds_mem = model["assumptions"]["daemonset_memory_mib"]
    for w in workloads(objs):
        cpu, mem = pod_requests(w)
        known = [t for t in offered_instance_types(w) if t in nodes]
        for t in known:
            n = nodes[t]
            room_cpu = n["allocatable_cpu_millis"] - ds_cpu
            room_mem = n["allocatable_memory_mib"] - ds_mem
            assert cpu <= room_cpu and mem <= room_mem, (
                f"{name}: {w['metadata']['name']} requests {cpu}m CPU / {mem:.0f} MiB but a {t} node leaves "
                f"{room_cpu}m / {room_mem:.0f} MiB next to the DaemonSets (epserve plan --node-model)")


def test_etcd_and_the_coordinator_can_use_their_own_nodes():
    values = deep_merge(load_values(CHART / "values.yaml"), {
        "etcd": {"nodeSelector": {"eks.amazonaws.com/nodegroup": "system"}},
        "coordinator": {"instanceFamilies": ["r8g"], "instanceSizes": ["24xlarge"], "resources": {"cpu": 90, "memory": "700Gi"}},
        "expertWorkers": {"instanceSizes": ["16xlarge"]},
    })
    objs = render(values)
    etcd = find(objs, "StatefulSet", fullname("etcd"))
    spec = etcd["spec"]["template"]["spec"]
    # etcd: by default no instance-type constraint, only the architecture and its own selector.
    assert offered_instance_types(etcd) == []
    assert spec["nodeSelector"] == {"kubernetes.io/arch": "arm64", "eks.amazonaws.com/nodegroup": "system"}
    assert offered_instance_types(find(objs, "Deployment", fullname("coordinator"))) == ["r8g.24xlarge"]
    assert offered_instance_types(find(objs, "StatefulSet", fullname("expert-worker"))) == [
        f"{f}.16xlarge" for f in values["scheduling"]["instanceFamilies"]]
    pinned = deep_merge(load_values(CHART / "values.yaml"), {"etcd": {"instanceFamilies": ["m7g"], "instanceSizes": ["large"]}})
    assert offered_instance_types(find(render(pinned), "StatefulSet", fullname("etcd"))) == ["m7g.large"]


def rust_metric_names() -> set[str]:
    names = set()
    for path in REPO.glob("*/src/**/*.rs"):
        names |= set(re.findall(r'"(epserve_[a-z0-9_]+)"', path.read_text()))
    return names


def test_grafana_dashboard():
    values = deep_merge(load_values(CHART / "values.yaml"), {"metrics": {"grafanaDashboard": {"enabled": True}}})
    objs = render(values)
    (cm,) = [o for o in by_kind(objs, "ConfigMap") if o["metadata"]["name"] == fullname("dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["epserve.json"])
    assert dash["uid"] and dash["title"] == "epserve"
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    known = rust_metric_names()
    used = set()
    for e in exprs:
        for m in re.findall(r"\b(epserve_[a-z0-9_]+)", e):
            base = re.sub(r"_(bucket|sum|count)$", "", m)
            assert base in known, f"dashboard query uses {m}, which no epserve code exports: {e}"
            used.add(base)
    # What the dashboard must show (issue: throughput, TTFT/TPOT, per-worker dispatch
    # latency, expert load heat map, balancedness).
    for must in ("epserve_generation_tokens_total", "epserve_time_to_first_token_seconds",
                 "epserve_time_per_output_token_seconds", "epserve_expert_worker_compute_seconds",
                 "epserve_dispatch_seconds", "epserve_eplb_expert_tokens", "epserve_eplb_balancedness"):
        assert must in used, must
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert not [o for o in by_kind(render(load_values(CHART / "values.yaml")), "ConfigMap")
                if o["metadata"]["name"] == fullname("dashboard")], "the dashboard is opt-in"


def test_values_schema_is_current():
    import values_schema
    assert (CHART / "values.schema.json").read_text() == values_schema.build(), \
        "values.schema.json is stale: run python deploy/tests/values_schema.py"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"coordinator": {"replica": 2}}, "replica"),
        ({"expertWorkers": {"resources": {"cpu": "14"}}}, "cpu"),
        ({"expertWorkers": {"resources": {"cpu": 2.5}}}, "cpu"),
        ({"coordinator": {"kvCacheDtype": "fp8"}}, "kvCacheDtype"),
        ({"model": {"source": "http"}}, "source"),
        ({"etcd": {"persistance": {"enabled": False}}}, "persistance"),
    ],
)
def test_values_schema_rejects_typos(values, message):
    with pytest.raises(helm.HelmError) as e:
        render(values)
    assert "schema" in str(e.value) and message in str(e.value), str(e.value)


def test_scaling_workers_does_not_restart_the_coordinator():
    base = load_values(CHART / "values.yaml")
    before = find(render(base), "Deployment", fullname("coordinator"))
    after = find(render(deep_merge(base, {"expertWorkers": {"replicas": 7}})), "Deployment", fullname("coordinator"))
    assert before["spec"]["template"] == after["spec"]["template"]


def test_update_strategies_fit_whole_node_pods():
    objs = render(load_values(CHART / "values.yaml"))
    assert find(objs, "Deployment", fullname("coordinator"))["spec"]["strategy"] == {"type": "Recreate"}
    for component in ("expert-worker", "attention-worker"):
        values = deep_merge(load_values(CHART / "values.yaml"), {"attentionWorkers": {"replicas": 2}})
        sts = find(render(values), "StatefulSet", fullname(component))
        # One pod at a time, each after the previous one is Ready (experts loaded) for minReadySeconds.
        assert sts["spec"]["updateStrategy"] == {"type": "RollingUpdate"}
        assert sts["spec"]["minReadySeconds"] >= 1
    rolling = deep_merge(load_values(CHART / "values.yaml"), {"coordinator": {"updateStrategy": "RollingUpdate"}})
    strategy = find(render(rolling), "Deployment", fullname("coordinator"))["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


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
