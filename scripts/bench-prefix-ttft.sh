#!/usr/bin/env bash
# Issue 19's prefix-caching check: a shared ~1k-token system prompt with 16
# different questions, sent one at a time (`epserve bench serve --dataset-name
# prefix --num-prefixes 1`), against `epserve serve` with prefix caching on and
# with `--no-enable-prefix-caching`. Prints the TTFT of the first request and
# the mean / median TTFT of the later 15 for each, their ratio, whether the 16
# outputs are identical (greedy), and the prefix cache counters of the cached
# server (hits should be ~15 x the prefix, rounded down to whole blocks).
#
# Usage: scripts/bench-prefix-ttft.sh [MODEL_DIR]   (default /work/peer/bench-model)
# Environment (optional): EPSERVE (default target/release/epserve), PREFIX_LEN=1024
#   SUFFIX_LEN=32 OUTPUT_LEN=16 PROMPTS=16 PORT=18433 READY_TIMEOUT=600
#   EXTRA_FLAGS="" (serve flags for both servers), OUT=/tmp/prefix-ttft-<stamp>
#   UP=1: run `epserve up --expert-workers 1 --attention-workers 2` instead of `serve`
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL=${1:-/work/peer/bench-model}
EPSERVE=${EPSERVE:-$ROOT/target/release/epserve}
PREFIX_LEN=${PREFIX_LEN:-1024}
SUFFIX_LEN=${SUFFIX_LEN:-32}
OUTPUT_LEN=${OUTPUT_LEN:-16}
PROMPTS=${PROMPTS:-16}
PORT=${PORT:-18433}
READY_TIMEOUT=${READY_TIMEOUT:-600}
EXTRA_FLAGS=${EXTRA_FLAGS:-}
UP=${UP:-0}
OUT=${OUT:-/tmp/prefix-ttft-$(date +%Y%m%d-%H%M%S)}
URL=http://127.0.0.1:$PORT
mkdir -p "$OUT"
[[ -x $EPSERVE ]] || { echo "no $EPSERVE: cargo build --release -p epserve" >&2; exit 1; }

SERVER_PID=
stop() {
    if [[ -n $SERVER_PID ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop EXIT

run() { # label, then serve flags
    local label=$1; shift
    # shellcheck disable=SC2086
    if [[ $UP == 1 ]]; then
        "$EPSERVE" up --model "$MODEL" --expert-workers 1 --attention-workers 2 \
            --port "$PORT" --served-model-name bench -- "$@" $EXTRA_FLAGS \
            >"$OUT/$label.log" 2>&1 &
    else
        "$EPSERVE" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
            --served-model-name bench "$@" $EXTRA_FLAGS >"$OUT/$label.log" 2>&1 &
    fi
    SERVER_PID=$!
    local t0=$SECONDS
    until [[ $(curl -s -o /dev/null -w '%{http_code}' "$URL/health" || true) == 200 ]]; do
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$OUT/$label.log" >&2; exit 1; }
        (( SECONDS - t0 < READY_TIMEOUT )) || { echo "$label: not ready" >&2; exit 1; }
        sleep 1
    done
    "$EPSERVE" bench serve --base-url "$URL" --model bench --tokenizer "$MODEL" \
        --dataset-name prefix --prefix-len "$PREFIX_LEN" --suffix-len "$SUFFIX_LEN" \
        --num-prefixes 1 --output-len "$OUTPUT_LEN" --num-prompts "$PROMPTS" \
        --max-concurrency 1 --temperature 0 --seed 0 --disable-tqdm \
        --percentile-metrics ttft,tpot,e2el --metric-percentiles 50 \
        --save-result "$OUT/$label.json" --save-detailed >"$OUT/$label.bench.txt"
    curl -s "$URL/metrics" | grep '^epserve_prefix_cache' >"$OUT/$label.metrics" || true
    stop
}

run cached
run uncached --no-enable-prefix-caching

python3 - "$OUT" "$PREFIX_LEN" "$PROMPTS" <<'PY'
import json, statistics, sys
out, prefix_len, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
r = {k: json.load(open(f"{out}/{k}.json")) for k in ("cached", "uncached")}
def later(k):
    t = r[k]["ttfts"][1:]
    return statistics.mean(t) * 1e3, statistics.median(t) * 1e3
for k in r:
    m, med = later(k)
    print(f"{k:9} first TTFT {r[k]['ttfts'][0]*1e3:8.1f} ms | later {n-1}: mean {m:8.1f} ms, median {med:8.1f} ms | failed {r[k]['failed']}")
(cm, cmed), (um, umed) = later("cached"), later("uncached")
print(f"later TTFT uncached / cached: mean {um/cm:.1f}x, median {umed/cmed:.1f}x")
same = r["cached"]["generated_texts"] == r["uncached"]["generated_texts"]
print(f"outputs identical: {same} ({len(r['cached']['generated_texts'])} requests)")
print("cached server's counters:", " ".join(open(f"{out}/cached.metrics").read().split("\n")).strip())
print("uncached server's counters:", " ".join(open(f"{out}/uncached.metrics").read().split("\n")).strip() or "(none: caching off)")
PY
echo "results in $OUT"
