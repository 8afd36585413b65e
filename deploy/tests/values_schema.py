"""Builds deploy/helm/epserve/values.schema.json from values.yaml, so a typo in a
values file (an unknown key, a string where a number belongs, an unknown enum
value) fails `helm install` / `helm template` before anything is created.

Every key of values.yaml is in the schema with the type of its default; objects
are closed (additionalProperties: false) except the free-form maps listed in
FREE_FORM (labels, annotations, selectors, probes, security contexts, ...).
ENUMS and TYPES refine what a default alone cannot say. The chart test checks
that the committed schema is what this script writes, so values.yaml and the
schema cannot drift apart.

    python deploy/tests/values_schema.py          # rewrite the schema
    python deploy/tests/values_schema.py --check  # exit 1 when it is stale
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

CHART = Path(__file__).resolve().parent.parent / "helm" / "epserve"
SCHEMA = CHART / "values.schema.json"

# Paths (dotted, "*" for any key) whose value is a free-form object.
FREE_FORM = {
    "podSecurityContext", "securityContext", "serviceAccount.annotations",
    "model.s3.securityContext",
    "*.podAnnotations", "*.podLabels", "*.nodeSelector",
    "*.startupProbe", "*.readinessProbe", "*.livenessProbe",
    "*.service.annotations", "*.adminService.annotations",
    "metrics.serviceMonitor.labels", "metrics.grafanaDashboard.labels", "metrics.grafanaDashboard.annotations",
    "etcd.resources",
}

# Enumerations (the templates also fail with a message for the ones they check).
ENUMS = {
    "model.source": ["pvc", "hostPath", "s3"],
    "model.s3.cache.type": ["hostPath", "emptyDir"],
    "image.pullPolicy": ["Always", "IfNotPresent", "Never"],
    "*.pullPolicy": ["Always", "IfNotPresent", "Never"],
    "scheduling.nodeAffinity": ["required", "preferred", "none"],
    "*.antiAffinity": ["hard", "soft", "none"],
    "*.advertise": ["dns", "podIP"],
    "*.podManagementPolicy": ["Parallel", "OrderedReady"],
    "*.service.type": ["ClusterIP", "NodePort", "LoadBalancer"],
    "*.adminService.type": ["ClusterIP", "NodePort", "LoadBalancer"],
    "coordinator.updateStrategy": ["Recreate", "RollingUpdate"],
    "coordinator.kvCacheDtype": ["", "auto", "bf16", "f32"],
    "coordinator.denseDtype": ["", "auto", "bf16", "int8"],
    "coordinator.dispatchDtype": ["", "bf16", "f32", "int8"],
    "coordinator.expertPrecisionPolicy": ["", "fixed", "load"],
    "expertWorkers.expertDtype": ["", "bf16", "int8"],
    "tls.certManager.privateKeyAlgorithm": ["ECDSA", "RSA", "Ed25519"],
    "*.issuerRef.kind": ["Issuer", "ClusterIssuer"],
    "etcd.replicas": [1, 3, 5],
}

# Types a default cannot show (null defaults, "" meaning "the binary's default").
TYPES = {
    "coordinator.maxModelLen": {"type": ["integer", "null"], "minimum": 1},
    "coordinator.expertBf16Share": {"type": ["number", "null"], "minimum": 0, "maximum": 1},
    "coordinator.microBatches": {"anyOf": [{"type": "string", "pattern": "^(|auto|[1-9][0-9]*)$"},
                                           {"type": "integer", "minimum": 1}]},
    "expertWorkers.terminationGracePeriodSeconds": {"anyOf": [{"type": "string", "maxLength": 0},
                                                              {"type": "integer", "minimum": 1}]},
    # epserve's size syntax (parse_size): bytes, or a number with B, KB/MB/GB, KiB/MiB/GiB.
    "expertWorkers.expertMemory": {"type": "string",
                                   "pattern": "^$|^[0-9]+(\\.[0-9]+)?\\s*([kKmMgG]i?[bB]?|[bB])?$"},
    "*.resources.cpu": {"type": "integer", "minimum": 1},
    "*.resources.memory": {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$"},
    "*.replicas": {"type": "integer", "minimum": 0},
    "coordinator.replicas": {"type": "integer", "minimum": 1},
    "*.port": {"type": "integer", "minimum": 1, "maximum": 65535},
    "*.adminPort": {"type": "integer", "minimum": 1, "maximum": 65535},
    "etcd.clientPort": {"type": "integer", "minimum": 1, "maximum": 65535},
    "etcd.peerPort": {"type": "integer", "minimum": 1, "maximum": 65535},
    "etcd.metricsPort": {"type": "integer", "minimum": 1, "maximum": 65535},
    "coordinator.eplb.minImprovement": {"type": "number", "minimum": 0},
}

# Keys that were removed: the schema lets them through so that the chart's
# epserve.removedValues fails with what to use instead.
REMOVED = {
    "tls": ["cert", "key", "ca", "existingSecretHasCa"],
    "metrics": ["workerPort"],
}

# List items: strings for these, free-form objects for every other list.
STRING_LISTS = {"*.instanceFamilies", "*.instanceSizes", "model.servedModelName", "*.extraArgs",
                "*.dnsNames", "*.loadBalancerSourceRanges", "*.endpoints", "model.s3.extraArgs"}


def matches(path: str, patterns) -> str | None:
    """The pattern (exact dotted path, or "*.suffix") that `path` matches."""
    if path in patterns:
        return path
    for p in patterns:
        if p.startswith("*.") and (path == p[2:] or path.endswith("." + p[2:])):
            return p
    return None


def lookup(path: str, table: dict):
    key = matches(path, table)
    return table[key] if key is not None else None


def schema_of(value, path: str) -> dict:
    if isinstance(value, dict) and matches(path, FREE_FORM):
        return {"type": "object"}
    override = lookup(path, TYPES)
    enum = lookup(path, ENUMS)
    if enum is not None:
        return {"enum": enum}
    if override is not None:
        return dict(override)
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if value is None:
        raise SystemExit(f"values.yaml: {path} defaults to null: give its type in TYPES")
    if isinstance(value, list):
        items = {"type": "string"} if matches(path, STRING_LISTS) else {"type": "object"}
        return {"type": "array", "items": items}
    if isinstance(value, dict):
        props = {k: schema_of(v, f"{path}.{k}" if path else k) for k, v in value.items()}
        for k in REMOVED.get(path, []):
            props[k] = {"description": "removed: the chart fails and says what replaces it"}
        return {"type": "object", "additionalProperties": False, "properties": props}
    raise SystemExit(f"values.yaml: {path}: unexpected {type(value).__name__}")


def build() -> str:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    root = schema_of(values, "")
    root = {"$schema": "https://json-schema.org/draft-07/schema#",
            "title": "epserve chart values (generated by deploy/tests/values_schema.py from values.yaml)",
            **root}
    return json.dumps(root, indent=2) + "\n"


def main() -> None:
    text = build()
    if "--check" in sys.argv:
        if not SCHEMA.is_file() or SCHEMA.read_text() != text:
            print(f"{SCHEMA} is stale: run python deploy/tests/values_schema.py", file=sys.stderr)
            sys.exit(1)
        return
    SCHEMA.write_text(text)
    print(f"wrote {SCHEMA}")


if __name__ == "__main__":
    main()
