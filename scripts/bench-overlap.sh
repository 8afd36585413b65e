#!/usr/bin/env bash
# Issue 17's benchmark: does the cluster pay for itself? `epserve up` with one
# expert-worker, the coordinator pinned to one core and the worker to another
# (as two nodes would be), measured with `epserve bench serve` at concurrency 16
# on prefill-heavy (512 in / 32 out) and decode-heavy (128 in / 512 out)
# traffic, for each coordinator `--micro-batches` setting, with and without the
# link emulator (`up --emulate-link`) on the prefill-heavy traffic; then
# `epserve up` with default settings (all roles sharing all cores) beside
# `epserve serve` on the same model for the overhead ratio. Prints a markdown
# table of output tok/s and the ratios the issue's targets are stated in.
#
# Usage: scripts/bench-overlap.sh [MODEL_DIR]   (default: /work/peer/bench-model,
#        made by scripts/make_bench_model.py; see scripts/bench-peer.sh)
#
# Environment (all optional):
#   EPSERVE=path          epserve binary (default target/release/epserve, built if missing)
#   MB_CONFIGS="1 auto"   coordinator `--micro-batches` values to compare; `default`
#                         passes no flag (the default when the coordinator has no
#                         --micro-batches flag yet)
#   LINK=500us            the emulated link for the latency-hiding runs (`up
#                         --emulate-link`); empty: no delayed runs
#   CONCURRENCY=16
#   PREFILL_PROMPTS=16 DECODE_PROMPTS=16   prompts per run
#   PREFILL_IN=512 PREFILL_OUT=32 DECODE_IN=128 DECODE_OUT=512
#   COORDINATOR_CORES=0 WORKER_CORES=1     pinning of the pinned runs
#   OVERHEAD=1            also run `up` with default settings and `epserve serve` (0: skip)
#   COORDINATOR_FLAGS=""  extra coordinator / serve flags for every server (serve's
#                         flags only: `serve` gets them too)
#   RUNS="serve up-default"   run only these servers (labels as in the table:
#                         pinned-mb1, pinned-mb1-link, ..., up-default, serve); the
#                         table shows every result already in OUT
#   PORT=18432            port on 127.0.0.1 (one server at a time)
#   READY_TIMEOUT=600     seconds a server may take to load
#   OUT=/tmp/bench-overlap-<stamp>   results, logs and the table (table.md)
#   TABLE_ONLY=1          no runs: print the table of the results already in OUT
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
MODEL=${1:-${MODEL:-/work/peer/bench-model}}
EPSERVE=${EPSERVE:-$ROOT/target/release/epserve}
LINK=${LINK-500us}
CONCURRENCY=${CONCURRENCY:-16}
PREFILL_PROMPTS=${PREFILL_PROMPTS:-16}
DECODE_PROMPTS=${DECODE_PROMPTS:-16}
PREFILL_IN=${PREFILL_IN:-512}
PREFILL_OUT=${PREFILL_OUT:-32}
DECODE_IN=${DECODE_IN:-128}
DECODE_OUT=${DECODE_OUT:-512}
COORDINATOR_CORES=${COORDINATOR_CORES:-0}
WORKER_CORES=${WORKER_CORES:-1}
OVERHEAD=${OVERHEAD:-1}
PORT=${PORT:-18432}
READY_TIMEOUT=${READY_TIMEOUT:-600}
OUT=${OUT:-/tmp/bench-overlap-$(date +%Y%m%d-%H%M%S)}
NAME=bench
URL=http://127.0.0.1:$PORT
START=$(date +%s)

log() { printf '[bench-overlap %4ds] %s\n' "$(($(date +%s) - START))" "$*" >&2; }

if [[ ! -f $MODEL/config.json ]]; then
    echo "error: no model at $MODEL; make one with scripts/make_bench_model.py (see scripts/bench-peer.sh)" >&2
    exit 1
fi
command -v etcd >/dev/null || {
    echo "error: etcd is not on PATH (apt-get install etcd-server)" >&2
    exit 1
}
if [[ ! -x $EPSERVE ]]; then
    log "building $EPSERVE (cargo build --release -p epserve)"
    (cd "$ROOT" && nice -n 10 cargo build --release -p epserve)
fi
if [[ -z ${MB_CONFIGS:-} ]]; then
    if "$EPSERVE" coordinator --help 2>/dev/null | grep -q -- --micro-batches; then
        MB_CONFIGS="1 auto"
    else
        log "this coordinator has no --micro-batches: measuring its default only (set MB_CONFIGS)"
        MB_CONFIGS=default
    fi
fi
mkdir -p "$OUT"
COMMON=(--max-num-seqs "$CONCURRENCY" --max-model-len 4096 --kv-cache-memory 1GiB)
# shellcheck disable=SC2206 # flags split on spaces on purpose
COMMON+=(${COORDINATOR_FLAGS:-})

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

start_server() { # LABEL COMMAND...
    local label=$1
    shift
    "$@" >"$OUT/$label.log" 2>&1 &
    SERVER_PID=$!
    echo "$*" >"$OUT/$label.cmd"
    local deadline=$(($(date +%s) + READY_TIMEOUT))
    until [[ $(curl -s -o /dev/null -w '%{http_code}' "$URL/health" || true) == 200 ]]; do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            echo "error: $label exited while loading; tail of $OUT/$label.log:" >&2
            tail -n 20 "$OUT/$label.log" >&2
            exit 1
        fi
        if (($(date +%s) > deadline)); then
            echo "error: $label not ready after ${READY_TIMEOUT}s; see $OUT/$label.log" >&2
            exit 1
        fi
        sleep 1
    done
}

bench() { # OUT_JSON INPUT OUTPUT PROMPTS SEED [ARGS...]
    local out=$1 input=$2 output=$3 n=$4 seed=$5
    shift 5
    "$EPSERVE" bench serve --base-url "$URL" --model "$MODEL" --served-model-name "$NAME" \
        --dataset-name random --random-input-len "$input" --random-output-len "$output" \
        --num-prompts "$n" --max-concurrency "$CONCURRENCY" --seed "$seed" --ignore-eos \
        --temperature 0 --percentile-metrics ttft,tpot,e2el --metric-percentiles 50 \
        --disable-tqdm --save-result "$out" "$@" >"${out%.json}.txt" 2>&1 ||
        log "bench failed, see ${out%.json}.txt"
}

# One server: warm-up, then TRAFFIC (prefill, decode or both) with the same
# seeds as every other server (the same prompts everywhere).
run() { # LABEL TRAFFIC COMMAND...
    local label=$1 traffic=$2
    shift 2
    if [[ -n ${RUNS:-} && " $RUNS " != *" $label "* ]]; then
        return 0
    fi
    log "starting $label"
    start_server "$label" "$@"
    bench "$OUT/$label-warmup.json" 64 8 2 999
    # /metrics before and after each run: the phase times of its steps.
    if [[ $traffic == *prefill* ]]; then
        log "$label: prefill-heavy ($PREFILL_IN in / $PREFILL_OUT out), $PREFILL_PROMPTS prompts"
        curl -s "$URL/metrics" >"$OUT/$label-prefill.metrics0" || true
        bench "$OUT/$label-prefill.json" "$PREFILL_IN" "$PREFILL_OUT" "$PREFILL_PROMPTS" 1 --label "$label"
        curl -s "$URL/metrics" >"$OUT/$label-prefill.metrics1" || true
    fi
    if [[ $traffic == *decode* ]]; then
        log "$label: decode-heavy ($DECODE_IN in / $DECODE_OUT out), $DECODE_PROMPTS prompts"
        curl -s "$URL/metrics" >"$OUT/$label-decode.metrics0" || true
        bench "$OUT/$label-decode.json" "$DECODE_IN" "$DECODE_OUT" "$DECODE_PROMPTS" 2 --label "$label"
        curl -s "$URL/metrics" >"$OUT/$label-decode.metrics1" || true
    fi
    stop_server
}

UP=("$EPSERVE" up --model "$MODEL" --host 127.0.0.1 --port "$PORT" --served-model-name "$NAME")

LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
log "results in $OUT; --micro-batches configurations: $MB_CONFIGS"
if [[ ${TABLE_ONLY:-0} == 1 ]]; then
    MB_RUN=
    OVERHEAD_RUN=0
else
    MB_RUN=$MB_CONFIGS
    OVERHEAD_RUN=$OVERHEAD
fi
PIN=(--coordinator-cores "$COORDINATOR_CORES" --worker-cores "$WORKER_CORES")
for mb in $MB_RUN; do
    mbflag=()
    [[ $mb == default ]] || mbflag=(--micro-batches "$mb")
    run "pinned-mb$mb" prefill,decode "${UP[@]}" --expert-workers 1 "${PIN[@]}" -- \
        "${COMMON[@]}" "${mbflag[@]}"
    if [[ -n $LINK ]]; then
        run "pinned-mb$mb-link" prefill "${UP[@]}" --expert-workers 1 "${PIN[@]}" \
            --emulate-link "$LINK" -- "${COMMON[@]}" "${mbflag[@]}"
    fi
done
if [[ $OVERHEAD_RUN == 1 ]]; then
    run up-default prefill,decode "${UP[@]}" -- "${COMMON[@]}"
    run serve prefill,decode "$EPSERVE" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" \
        --served-model-name "$NAME" "${COMMON[@]}"
fi

{
    echo "epserve $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?') on" \
        "$(lscpu | sed -n 's/^Model name: *//p' | head -n 1), $(nproc) cores, $(date -u +%Y-%m-%d);" \
        "model $(basename "$MODEL"); concurrency $CONCURRENCY; load average $LOAD_BEFORE before," \
        "$(cut -d' ' -f1-3 /proc/loadavg) after; $(($(date +%s) - START)) s in all"
    echo
    python3 - "$OUT" "$MB_CONFIGS" "$LINK" "$COORDINATOR_CORES" "$WORKER_CORES" "$OVERHEAD" <<'PY'
import json, sys
from pathlib import Path
out, mbs, link, ccores, wcores, overhead = sys.argv[1:]
out, mbs = Path(out), mbs.split()
def load(label, traffic):
    f = out / f"{label}-{traffic}.json"
    if not f.exists():
        return None
    text = f.read_text()
    try:
        return json.loads(text)
    except ValueError:  # --append-result style: the last line
        return json.loads(text.splitlines()[-1])
def tps(label, traffic):
    r = load(label, traffic)
    return r["output_throughput"] if r else None
def metric_sums(label, traffic):
    """Sums of each metric's `_sum` and `_count` over all its labels, run only
    (after minus before)."""
    def read(f):
        out = {}
        if not f.exists():
            return None
        for line in f.read_text().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name = line.split("{")[0].split()[0]
            try:
                v = float(line.rsplit(None, 1)[1])
            except ValueError:
                continue
            out[name] = out.get(name, 0.0) + v
        return out
    a, b = read(out / f"{label}-{traffic}.metrics0"), read(out / f"{label}-{traffic}.metrics1")
    if a is None or b is None:
        return None
    return {k: b[k] - a.get(k, 0.0) for k in b}
def phases(label, traffic):
    """Per step, ms: the step S, the coordinator busy A (the step less its
    waits for dispatch), the worker busy E (its compute)."""
    m = metric_sums(label, traffic)
    if not m or not m.get("epserve_step_seconds_count"):
        return None
    steps = m["epserve_step_seconds_count"]
    s = m.get("epserve_step_seconds_sum", 0.0) / steps * 1e3
    # The scheduler thread's waits for remote work (experts and attention);
    # older coordinators: the dispatch round trips.
    w = m.get("epserve_step_wait_seconds_sum", m.get("epserve_dispatch_seconds_sum", 0.0))
    d = w / steps * 1e3
    e = m.get("epserve_expert_worker_compute_seconds_sum", 0.0) / steps * 1e3
    return steps, s, s - d, e
def fmt(x, d=1):
    return "-" if x is None else f"{x:.{d}f}"
rows = []
for mb in mbs:
    rows.append((f"pinned-mb{mb}", f"up, 1 expert-worker, coordinator on core {ccores}, worker on {wcores}, --micro-batches {mb}"))
    if link:
        rows.append((f"pinned-mb{mb}-link", f"the same with --emulate-link {link}"))
if overhead == "1":
    rows.append(("up-default", "up with default settings (2 expert-workers, no pinning)"))
    rows.append(("serve", "epserve serve"))
print("| server | traffic | prompts | out tok/s | TTFT p50 ms | TPOT p50 ms |")
print("| --- | --- | --- | --- | --- | --- |")
notes = []
for label, desc in rows:
    for traffic in ("prefill", "decode"):
        r = load(label, traffic)
        if r is None:
            if (out / f"{label}-{traffic}.txt").exists():
                print(f"| {desc} | {traffic} | | failed | | |")
            continue
        mark = ""
        if r.get("failed"):
            mark = " ⚠"
            notes.append(f"{label} {traffic}: {r['failed']} failed")
        print(f"| {desc} | {traffic} | {r['num_prompts']} | {fmt(r['output_throughput'])}{mark} "
              f"| {fmt(r.get('median_ttft_ms'), 0)} | {fmt(r.get('median_tpot_ms'))} |")
print()
def ratio(a, b):
    return f"{a / b:.3f}x" if a and b else "-"
print("| ratio | measured | target |")
print("| --- | --- | --- |")
if "1" in mbs and "auto" in mbs:
    print(f"| prefill-heavy: auto / 1 | {ratio(tps('pinned-mbauto', 'prefill'), tps('pinned-mb1', 'prefill'))} | ≥ 1.15x |")
    print(f"| decode-heavy: auto / 1 | {ratio(tps('pinned-mbauto', 'decode'), tps('pinned-mb1', 'decode'))} | ≥ 0.98x |")
if link:
    for mb in mbs:
        target = "≥ 0.90x" if mb == "auto" else "(beside auto)"
        print(f"| prefill-heavy, {link} link / no delay, --micro-batches {mb} "
              f"| {ratio(tps(f'pinned-mb{mb}-link', 'prefill'), tps(f'pinned-mb{mb}', 'prefill'))} | {target} |")
if overhead == "1":
    for traffic in ("prefill", "decode"):
        print(f"| {traffic}-heavy: up (default settings) / serve | {ratio(tps('up-default', traffic), tps('serve', traffic))} | ≥ 0.9x |")
sync = "1" if "1" in mbs else mbs[0]
print()
print(f"Phase times per step of the `--micro-batches {sync}` runs (from /metrics: S = "
      "`epserve_step_seconds`, coordinator busy A = S less `epserve_step_wait_seconds` (its waits for remote work), "
      "worker busy E = `epserve_expert_worker_compute_seconds`; ideal step max(A, E)):")
print()
print("| traffic | steps | S ms | A ms | E ms | ideal step ms | ideal speedup | achieved (auto / 1) | achieved / ideal |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for traffic in ("prefill", "decode"):
    p = phases(f"pinned-mb{sync}", traffic)
    if p is None:
        continue
    steps, s, a, e = p
    ideal = max(a, e)
    speedup = s / ideal if ideal > 0 else None
    achieved = None
    if sync == "1" and "auto" in mbs:
        t1, ta = tps("pinned-mb1", traffic), tps("pinned-mbauto", traffic)
        achieved = ta / t1 if t1 and ta else None
    frac = achieved / speedup if achieved and speedup else None
    print(f"| {traffic} | {steps:.0f} | {s:.2f} | {a:.2f} | {e:.2f} | {ideal:.2f} | {fmt(speedup, 3)}x "
          f"| {fmt(achieved, 3)}{'x' if achieved else ''} | {fmt(frac, 3)} |")
for n in notes:
    print(f"- ⚠ {n}")
PY
} | tee "$OUT/table.md"
log "done; table in $OUT/table.md"
