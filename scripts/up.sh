#!/usr/bin/env bash
# The main job (README): a local cluster on the bundled tiny Qwen3-MoE model —
# etcd, 3 expert-workers, 2 attention-workers (tensor-parallel attention) and the
# coordinator on loopback — serving the OpenAI
# API at http://127.0.0.1:8000/v1 until Ctrl-C. Extra arguments go to `epserve up`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
exec cargo run --bin epserve -- up --model tests/fixtures/qwen3_moe_a/bf16 \
    --served-model-name tiny-qwen3-moe --expert-workers 3 --attention-workers 2 --port 8000 "$@"
