#!/usr/bin/env bash
# Offline checks of the Helm chart (deploy/helm/epserve), for CI and by hand:
# renders it with Helm's Go SDK for the default values, the example values files
# and variants, validates every object against the Kubernetes 1.33 API schemas
# (strict) and with yamllint, checks the wiring between objects, and, when the
# epserve binary is built (target/debug or EPSERVE_BIN), checks every flag the chart
# passes to an epserve container against `epserve <role> --help` (strict: an unknown
# flag fails) and renders `epserve plan --helm-values` output.
# Needs python3 (3.10+) with venv and pip access to PyPI. Exits non-zero on any error.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${EPSERVE_DEPLOY_VENV:-${TMPDIR:-/tmp}/epserve-deploy-venv}"

echo "== deploy: python venv at $venv"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check -r "$here/requirements.txt"

bin="${EPSERVE_BIN:-}"
if [ -z "$bin" ]; then
    for p in "$here/../target/debug/epserve" "$here/../target/release/epserve"; do
        if [ -x "$p" ]; then bin="$p"; break; fi
    done
fi
if [ -n "$bin" ]; then
    echo "== deploy: checking chart flags against $bin"
    export EPSERVE_BIN="$bin"
else
    echo "== deploy: WARNING: no epserve binary built: flag cross-check and plan values are skipped" >&2
fi

echo "== deploy: chart render, schemas, yamllint, wiring (pytest)"
"$venv/bin/python" -m pytest -q -rs -W default -p no:cacheprovider "$here/tests"

echo "== deploy: kubernetes-validate --strict -k 1.33 on every rendered scenario"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$venv/bin/python" "$here/tests/render.py" "$out" >/dev/null
# ServiceMonitor, Certificate and Issuer (CRDs of the Prometheus Operator and
# cert-manager) have no bundled schema: kubernetes-validate warns and the pytest
# suite checks their shape; every other object must pass.
"$venv/bin/kubernetes-validate" --strict -k 1.33 --quiet "$out"/*.yaml
echo "== deploy: OK"
