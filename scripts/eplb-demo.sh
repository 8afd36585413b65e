#!/usr/bin/env bash
# Hot-expert replication and live rebalancing, as an operator would try it
# (README "Rebalancing experts"): a local cluster, skewed traffic from
# `epserve bench serve`, `epserve ctl load`, `rebalance --dry-run`,
# `rebalance`, the same traffic again, `drain`, and the traffic once more —
# throughput and balancedness before and after, in one run.
#
#   scripts/eplb-demo.sh [MODEL_DIR]      (default: the olmoe fixture, 13 experts)
#
# EPSERVE_BIN picks the binary (default: target/debug/epserve, built if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-tests/fixtures/olmoe/f32}
BIN=${EPSERVE_BIN:-target/debug/epserve}
[ -x "$BIN" ] || cargo build --bin epserve
TOKEN=demo-$$
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
LOG=$(mktemp)
"$BIN" up --model "$MODEL" --served-model-name demo --expert-workers 3 --port "$PORT" \
    --dispatch-dtype f32 -- --admin-token "$TOKEN" >"$LOG" 2>&1 &
UP=$!
trap 'kill $UP 2>/dev/null; wait $UP 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 1 600); do
    grep -q "cluster ready" "$LOG" && break
    sleep 0.2
done
grep -q "cluster ready" "$LOG" || { cat "$LOG"; echo "cluster did not start" >&2; exit 1; }
ADMIN=$(sed -n 's/.*admin gRPC at \([0-9.:]*\).*/\1/p' "$LOG" | head -1)
ctl() { "$BIN" ctl --admin "$ADMIN" --token "$TOKEN" "$@"; }
bench() {
    "$BIN" bench serve --base-url "http://127.0.0.1:$PORT" --model demo --tokenizer "$MODEL" \
        --random-input-len 128 --random-output-len 32 --random-token-pool 2 \
        --num-prompts 48 --max-concurrency 8 --disable-tqdm 2>/dev/null |
        grep -E "Successful requests|Failed requests|Output token throughput|Mean TPOT"
}
step() { printf '\n=== %s\n' "$*"; }

step "wrong admin token"
"$BIN" ctl --admin "$ADMIN" --token wrong workers 2>&1 || true
step "workers"; ctl workers
step "skewed traffic (prompts from 2 token ids), initial placement"; bench
step "load"; ctl load
step "rebalance --dry-run --redundant 4"; ctl rebalance --dry-run --redundant 4
step "rebalance --redundant 4"; ctl rebalance --redundant 4
step "placement"; ctl placement
step "the same traffic, rebalanced"; bench
step "load"; ctl load --png /tmp/epserve-eplb-load.png
step "drain expert-2"; ctl drain expert-2
step "workers"; ctl workers
step "the same traffic, expert-2 drained"; bench
step "status"; ctl status
