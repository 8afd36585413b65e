#!/usr/bin/env bash
# Issue 20's check of `epserve plan` against measurement: the planner's
# prediction for a loopback cluster on this machine (`epserve up`, one
# coordinator and WORKERS expert-workers sharing its cores) next to what
# `epserve bench serve` measures on that cluster, per concurrency.
#
#   1. `epserve bench moe --json` on this machine -> the calibration (bandwidth,
#      the decode kernels' share of it, expert GFLOP/s per core).
#   2. Per concurrency C: a fresh `epserve up` cluster, `bench serve` with C
#      concurrent streams of IN prompt / OUT output tokens (ignore_eos,
#      greedy), then the coordinator's /metrics (the measured per-layer
#      dispatch overhead).
#   3. `epserve plan --instance local --calibration ... --dispatch-metrics ...
#      --simulate --nodes WORKERS+1 --batch C --context-len IN+OUT/2`: the
#      predicted decode step (TPOT) and tokens/s at batch C.
# Prints a markdown table: predicted vs measured TPOT and decode tokens/s
# (C / mean TPOT), and the measured output tokens/s (which also pays prefill).
#
# Usage: scripts/bench-plan-check.sh [MODEL_DIR]   (default /work/peer/bench2:
#   scripts/make_bench_model.py /work/peer/bench2 --layers 2)
# Environment (optional): EPSERVE (default target/release/epserve), WORKERS=2,
#   CONC="1 4 8", IN=32, OUT=96, PROMPTS_PER_CONC=3, PORT=18434, ZIPF=0 (the
#   simulated routing skew: 0 = uniform, as a random-weight router routes),
#   READY_TIMEOUT=600, EXTRA_FLAGS="" (coordinator flags), CAL=FILE (reuse a
#   bench moe JSON), RESULT_DIR=/tmp/plan-check-<stamp>
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL=${1:-/work/peer/bench2}
EPSERVE=${EPSERVE:-$ROOT/target/release/epserve}
WORKERS=${WORKERS:-2}
CONC=${CONC:-"1 4 8"}
IN=${IN:-32}
OUT=${OUT:-96}
PROMPTS_PER_CONC=${PROMPTS_PER_CONC:-3}
PORT=${PORT:-18434}
READY_TIMEOUT=${READY_TIMEOUT:-600}
EXTRA_FLAGS=${EXTRA_FLAGS:-}
ZIPF=${ZIPF:-0}
RESULT_DIR=${RESULT_DIR:-/tmp/plan-check-$(date +%Y%m%d-%H%M%S)}
URL=http://127.0.0.1:$PORT
mkdir -p "$RESULT_DIR"
[[ -x $EPSERVE ]] || { echo "no $EPSERVE: cargo build --release -p epserve" >&2; exit 1; }
[[ -f $MODEL/config.json ]] || { echo "no model in $MODEL" >&2; exit 1; }

CAL=${CAL:-$RESULT_DIR/bench-moe.json}
if [[ ! -f $CAL ]]; then
    echo "== calibration: epserve bench moe --json (all cores)" >&2
    "$EPSERVE" bench moe --shapes qwen3 --tokens 1,4,16,64 --dtypes bf16 --threads 0 \
        --scalar-iters 0 --rounds 2 --json >"$CAL"
fi

SERVER_PID=
stop() {
    if [[ -n $SERVER_PID ]]; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 150); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.2; done
        kill -9 "$SERVER_PID" 2>/dev/null || true
        wait "$SERVER_PID" 2>/dev/null || true
        SERVER_PID=
    fi
}
trap stop EXIT

for c in $CONC; do
    echo "== concurrency $c: epserve up --expert-workers $WORKERS" >&2
    # shellcheck disable=SC2086
    "$EPSERVE" up --model "$MODEL" --expert-workers "$WORKERS" --port "$PORT" \
        --served-model-name bench -- --max-num-seqs "$c" $EXTRA_FLAGS \
        >"$RESULT_DIR/up-$c.log" 2>&1 &
    SERVER_PID=$!
    t0=$SECONDS
    until [[ $(curl -s -o /dev/null -w '%{http_code}' "$URL/health" || true) == 200 ]]; do
        kill -0 "$SERVER_PID" 2>/dev/null || { tail -20 "$RESULT_DIR/up-$c.log" >&2; exit 1; }
        (( SECONDS - t0 < READY_TIMEOUT )) || { echo "cluster not ready" >&2; exit 1; }
        sleep 1
    done
    "$EPSERVE" bench serve --base-url "$URL" --model bench --tokenizer "$MODEL" \
        --dataset-name random --random-input-len "$IN" --random-output-len "$OUT" \
        --ignore-eos --max-concurrency "$c" --num-prompts $((c * PROMPTS_PER_CONC)) \
        --num-warmups 1 --temperature 0 --seed 0 --disable-tqdm \
        --percentile-metrics ttft,tpot,e2el --metric-percentiles 50 \
        --save-result "$RESULT_DIR/serve-$c.json" >"$RESULT_DIR/serve-$c.txt"
    curl -s "$URL/metrics" >"$RESULT_DIR/metrics-$c.txt"
    stop
    "$EPSERVE" plan --model "$MODEL" --instance local --calibration "$CAL" \
        --dispatch-metrics "$RESULT_DIR/metrics-$c.txt" --simulate --nodes $((WORKERS + 1)) \
        --zipf "$ZIPF" --batch "$c" --context-len $((IN + OUT / 2)) >"$RESULT_DIR/plan-$c.txt"
done

python3 - "$RESULT_DIR" "$CONC" <<'PY'
import json, re, sys
out, conc = sys.argv[1], [int(c) for c in sys.argv[2].split()]
print("| concurrency | plan TPOT ms | measured TPOT ms | plan decode tok/s | measured decode tok/s (C / TPOT) | measured / plan | output tok/s (with prefill) | dispatch overhead per layer |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for c in conc:
    r = json.load(open(f"{out}/serve-{c}.json"))
    plan = open(f"{out}/plan-{c}.txt").read()
    row = None
    for line in plan.splitlines():
        f = line.split()
        if len(f) >= 3 and f[0] == str(c) and re.match(r"^[0-9.]+$", f[1]):
            row = (float(f[1]), float(f[2]))
    if row is None:
        sys.exit(f"no batch {c} row in {out}/plan-{c}.txt")
    m = re.search(r"per-layer dispatch overhead (\d+) us", plan)
    tpot = r["mean_tpot_ms"]
    meas = c * 1000.0 / tpot
    print(f"| {c} | {row[0]:.2f} | {tpot:.2f} | {row[1]:.1f} | {meas:.1f} | {meas / row[1]:.2f}x | "
          f"{r['output_throughput']:.1f} | {m.group(1) + ' us' if m else '?'} |")
PY
echo "results in $RESULT_DIR" >&2
