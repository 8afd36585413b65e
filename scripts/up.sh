#!/usr/bin/env bash
# The main job (README): a local cluster on the bundled demo model (models/demo: a
# small Qwen3-MoE, 8 experts top-2, trained by scripts/make_demo_model.py to talk
# about Python) —
# etcd, 3 expert-workers, 2 attention-workers (tensor-parallel attention) and the
# coordinator on loopback — serving the OpenAI
# API at http://127.0.0.1:8000/v1 until Ctrl-C. Extra arguments go to `epserve up`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
exec cargo run --bin epserve -- up --model models/demo \
    --served-model-name demo --expert-workers 3 --attention-workers 2 --port 8000 "$@"
