#!/usr/bin/env bash
# Issue 21's benchmark: experts beyond RAM. `epserve serve` on the bench model
# with every expert packed (the fully resident run), then with
# `--expert-memory` at 50 % and 25 % of the experts' packed bytes, under
# skewed routing (`bench serve --random-token-pool`): output tok/s against the
# fully resident run, the cache hit rate (expert uses found packed), the
# prefetch hit rate (prefetched experts used before eviction), bytes paged in,
# and the server's anonymous RSS (RssAnon: the packed experts, dense weights,
# KV cache; the page cache of the mapped checkpoint is RssFile and not in it).
#
# Usage: scripts/bench-tiers.sh [MODEL_DIR]   (default: /work/peer/bench-model,
#        made by scripts/make_bench_model.py --layers 4 --vocab 8192)
#
# Environment (all optional):
#   EPSERVE=path        epserve binary (default target/release/epserve, built if missing)
#   FRACTIONS="100 50 25"  budgets in % of the experts' packed bytes (100: no
#                       --expert-memory at all, every expert packed at load)
#   POOL=16             --random-token-pool (skew; 0 = uniform prompts)
#   CONCURRENCY=4 PROMPTS=16 IN=128 OUT_LEN=64
#   PREFETCH=1          0 adds --no-expert-prefetch to the tiered runs
#   PORT=18433 READY_TIMEOUT=600
#   OUT=/tmp/bench-tiers-<stamp>   results, logs and the table (table.md)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL=${1:-${MODEL:-/work/peer/bench-model}}
EPSERVE=${EPSERVE:-$ROOT/target/release/epserve}
FRACTIONS=${FRACTIONS:-100 50 25}
POOL=${POOL:-16}
CONCURRENCY=${CONCURRENCY:-4}
PROMPTS=${PROMPTS:-16}
IN=${IN:-128}
OUT_LEN=${OUT_LEN:-64}
PREFETCH=${PREFETCH:-1}
PORT=${PORT:-18433}
READY_TIMEOUT=${READY_TIMEOUT:-600}
OUT=${OUT:-/tmp/bench-tiers-$(date +%Y%m%d-%H%M%S)}
URL=http://127.0.0.1:$PORT
START=$(date +%s)

log() { printf '[bench-tiers %4ds] %s\n' "$(($(date +%s) - START))" "$*" >&2; }

if [[ ! -f $MODEL/config.json ]]; then
    echo "error: no model at $MODEL; make one with scripts/make_bench_model.py" >&2
    exit 1
fi
if [[ ! -x $EPSERVE ]]; then
    log "building $EPSERVE"
    (cd "$ROOT" && cargo build --release -p epserve)
fi
mkdir -p "$OUT"

# Packed bytes of every expert: bf16 gate, up and down (hidden and the
# expert width are multiples of the panel padding for the bench shapes).
TOTAL=$(python3 - "$MODEL/config.json" <<'EOF'
import json, sys
c = json.load(open(sys.argv[1]))
layers = c["num_hidden_layers"]
step = c.get("decoder_sparse_step", 1) or 1
dense = set(c.get("mlp_only_layers", []) or [])
moe = sum(1 for i in range(layers) if i not in dense and (i + 1) % step == 0)
n = c.get("num_experts") or c.get("num_local_experts") or c["n_routed_experts"]
print(moe * n * 3 * c["hidden_size"] * c["moe_intermediate_size"] * 2)
EOF
)
log "experts: $TOTAL packed bytes"

SERVER_PID=
stop_server() {
    if [[ -n $SERVER_PID ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 1 150); do
            kill -0 "$SERVER_PID" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop_server EXIT
trap 'exit 130' INT TERM

if curl -s -o /dev/null "$URL/health"; then
    echo "error: something already listens on 127.0.0.1:$PORT (set PORT=...)" >&2
    exit 1
fi

metric() { # FILE NAME: sum of the samples of NAME
    awk -v n="$2" '$1 == n || index($1, n "{") == 1 { s += $2 } END { printf "%.0f\n", s }' "$1"
}

for f in $FRACTIONS; do
    label=mem$f
    flags=(--max-num-seqs "$CONCURRENCY" --max-model-len 4096 --kv-cache-memory 1GiB)
    if [[ $f != 100 ]]; then
        flags+=(--expert-memory $((TOTAL * f / 100)))
        [[ $PREFETCH == 1 ]] || flags+=(--no-expert-prefetch)
    fi
    log "starting serve ($f %): ${flags[*]}"
    "$EPSERVE" serve --model "$MODEL" --served-model-name bench --host 127.0.0.1 --port "$PORT" \
        "${flags[@]}" >"$OUT/$label.log" 2>&1 &
    SERVER_PID=$!
    deadline=$(($(date +%s) + READY_TIMEOUT))
    until [[ $(curl -s -o /dev/null -w '%{http_code}' "$URL/health" || true) == 200 ]]; do
        kill -0 "$SERVER_PID" 2>/dev/null || {
            tail -n 20 "$OUT/$label.log" >&2
            exit 1
        }
        (($(date +%s) < deadline)) || {
            echo "error: not ready after ${READY_TIMEOUT}s" >&2
            exit 1
        }
        sleep 1
    done
    # Warm-up with other prompts, then the measured run.
    "$EPSERVE" bench serve --base-url "$URL" --model "$MODEL" --served-model-name bench \
        --dataset-name random --random-input-len 64 --random-output-len 8 --num-prompts 2 \
        --seed 999 --ignore-eos --temperature 0 --random-token-pool "$POOL" --disable-tqdm \
        >"$OUT/$label-warmup.txt" 2>&1
    curl -s "$URL/metrics" >"$OUT/$label-before.prom"
    "$EPSERVE" bench serve --base-url "$URL" --model "$MODEL" --served-model-name bench \
        --dataset-name random --random-input-len "$IN" --random-output-len "$OUT_LEN" \
        --num-prompts "$PROMPTS" --max-concurrency "$CONCURRENCY" --seed 1 --ignore-eos \
        --temperature 0 --random-token-pool "$POOL" --percentile-metrics ttft,tpot \
        --metric-percentiles 50 --disable-tqdm --save-result "$OUT/$label.json" \
        >"$OUT/$label.txt" 2>&1
    curl -s "$URL/metrics" >"$OUT/$label-after.prom"
    grep -E '^(RssAnon|RssFile|VmHWM)' "/proc/$SERVER_PID/status" >"$OUT/$label.rss"
    stop_server
done

python3 - "$OUT" "$FRACTIONS" "$TOTAL" "$POOL" <<'EOF' | tee "$OUT/table.md"
import json, os, sys
out, fractions, total, pool = sys.argv[1], sys.argv[2].split(), int(sys.argv[3]), sys.argv[4]
def prom(path):
    d = {}
    for line in open(path):
        if line.startswith("#") or not line.strip():
            continue
        name, _, val = line.rpartition(" ")
        base = name.split("{")[0]
        try:
            d[base] = d.get(base, 0.0) + float(val)
        except ValueError:
            pass
    return d
def rss(path):
    d = {}
    for line in open(path):
        k, v = line.split(":")
        d[k] = int(v.split()[0]) * 1024
    return d
base = None
print(f"experts: {total / 1e9:.2f} GB packed; skewed prompts (--random-token-pool {pool})\n")
print("| expert memory | out tok/s | vs resident | TTFT p50 ms | TPOT p50 ms | hit rate | prefetched | prefetch hit rate | paged in GB | evictions | RssAnon GB |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for f in fractions:
    p = os.path.join(out, f"mem{f}.json")
    if not os.path.exists(p):
        continue
    r = json.load(open(p))
    tps = r["output_throughput"]
    if f == "100":
        base = tps
    a, b = prom(os.path.join(out, f"mem{f}-after.prom")), prom(os.path.join(out, f"mem{f}-before.prom"))
    d = lambda k: a.get(k, 0.0) - b.get(k, 0.0)
    hits, misses = d("epserve_expert_tier_hits_total"), d("epserve_expert_tier_misses_total")
    pf, pfh = d("epserve_expert_tier_prefetched_total"), d("epserve_expert_tier_prefetch_hits_total")
    paged, ev = d("epserve_expert_tier_paged_in_bytes_total"), d("epserve_expert_tier_evictions_total")
    m = rss(os.path.join(out, f"mem{f}.rss"))
    label = "all (no budget)" if f == "100" else f"{f} % ({total * int(f) / 100 / 1e9:.2f} GB)"
    hr = f"{hits / (hits + misses):.3f}" if hits + misses else "-"
    ph = f"{pfh / pf:.3f}" if pf else "-"
    ratio = f"{tps / base:.2f}x" if base else "-"
    print(f"| {label} | {tps:.1f} | {ratio} | {r['median_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | {hr} | {pf:.0f} | {ph} | {paged / 1e9:.2f} | {ev:.0f} | {m.get('RssAnon', 0) / 1e9:.2f} |")
EOF
log "done: $OUT/table.md"
