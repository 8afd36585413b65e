#!/usr/bin/env bash
# Side by side with llama.cpp (issue 15): epserve serve and llama.cpp's
# llama-server on the same machine, same threads, same weights, measured with
# `epserve bench serve` (the same client, the same prompts, ignore_eos, greedy,
# a new connection per request: llama-server closes a streamed response's
# connection though it announces keep-alive).
#
# Usage: scripts/bench-peer.sh [DIR]          (DIR default: /work/peer)
#
# Everything big lives in DIR, outside the repository, and is built only when
# missing (delete a path to rebuild it):
#   DIR/venv             Python 3.11 venv: tests/fixtures/requirements.txt + gguf, sentencepiece
#   DIR/llama.cpp        llama.cpp source from the llama-cpp-python sdist on PyPI,
#                        built in DIR/llama.cpp/build (llama-server, llama-bench)
#   DIR/bench-model      scripts/make_bench_model.py --layers 4 --vocab 8192 (bf16, ~5 GB)
#   DIR/bench-bf16.gguf  convert_hf_to_gguf.py --outtype bf16
#   DIR/bench-q8_0.gguf  convert_hf_to_gguf.py --outtype q8_0
#   DIR/runs/<stamp>/    bench serve JSON results and server logs of this run
# The markdown table goes to stdout and to $RESULT (default DIR/result.md).
#
# Environment (all optional):
#   EPSERVE=path         epserve binary (default: target/release/epserve, built if missing)
#   EPSERVE_FLAGS=""     extra `epserve serve` flags for both epserve servers
#   LLAMA_FLAGS=""       extra llama-server flags for both llama.cpp servers (e.g.
#                        --no-repack where its repacked/AMX Q8_0 path crashes at load)
#   EPSERVE_INT8_FLAGS="--expert-dtype int8 --dense-dtype int8"   what makes
#                        epserve-int8 (everything but routers and norms in int8, as Q8_0)
#   THREADS=2            threads of both servers (llama-server -t/-tb; epserve is pinned
#                        with taskset to as many cores, and so is llama-server)
#   WORKLOADS="quick long"   quick = 128 in / 64 out, long = 512 in / 512 out
#   CONCURRENCY="1 4 8"
#   QUICK_PROMPTS_PER_CONC=4 LONG_PROMPTS_PER_CONC=1   prompts per run = this x concurrency
#   MIN_PROMPTS=2        at least this many prompts per run
#   SERVERS="epserve-bf16 llama-bf16 epserve-int8 llama-q8_0"
#   PORT=18431           port on 127.0.0.1 (PAIRED: the second server of a pair on PORT+1)
#   PAIRED=1             1: the two servers of a precision (SERVERS taken two by two:
#                        epserve-bf16 with llama-bf16, epserve-int8 with llama-q8_0) are
#                        loaded at once, each idle while the other is measured, and every
#                        row runs on both back to back (the first alternating), so a ratio
#                        compares runs seconds apart, not minutes: this host's memory
#                        bandwidth swings by tens of percent over minutes. 0: one server at
#                        a time, all its rows, then the next (the order before).
#   ROUNDS=1             repeat every row this many times (fresh prompts each round); the
#                        table gives each figure's median over the rounds and each ratio's
#                        median (and range) over the rounds' paired ratios
#   READY_TIMEOUT=900    seconds a server may take to load
#   LLAMA_CPP_PYTHON_VERSION=0.3.36   the sdist llama.cpp comes from
#   RESULT=DIR/result.md
#   EPSERVE_COMMIT=abc1234   label of the epserve build in the table (default: the checkout's HEAD)
#   TABLE_FROM=DIR/runs/<stamp>   no runs: print the table of earlier results (copy a
#                        rerun server's JSON files into one folder to combine runs)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${1:-/work/peer}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
case "$DIR/" in
"$ROOT"/*)
    echo "error: $DIR is inside the repository; pick a directory outside it" >&2
    exit 1
    ;;
esac

THREADS=${THREADS:-2}
WORKLOADS=${WORKLOADS:-quick long}
CONCURRENCY=${CONCURRENCY:-1 4 8}
QUICK_PROMPTS_PER_CONC=${QUICK_PROMPTS_PER_CONC:-4}
LONG_PROMPTS_PER_CONC=${LONG_PROMPTS_PER_CONC:-1}
MIN_PROMPTS=${MIN_PROMPTS:-2}
SERVERS=${SERVERS:-epserve-bf16 llama-bf16 epserve-int8 llama-q8_0}
PORT=${PORT:-18431}
PAIRED=${PAIRED:-1}
ROUNDS=${ROUNDS:-1}
READY_TIMEOUT=${READY_TIMEOUT:-900}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
RESULT=${RESULT:-$DIR/result.md}
EPSERVE=${EPSERVE:-$ROOT/target/release/epserve}
VENV=$DIR/venv
PY=$VENV/bin/python
LLAMA=$DIR/llama.cpp
MODEL=$DIR/bench-model
NAME=bench
START=$(date +%s)

log() { printf '[bench-peer %4ds] %s\n' "$(($(date +%s) - START))" "$*" >&2; }

# --- 1. Python environment ---------------------------------------------------
if ! "$PY" -c 'import torch, transformers, tokenizers, safetensors, numpy, gguf, sentencepiece' 2>/dev/null; then
    log "creating $VENV (torch, transformers, gguf; PyPI's torch wheel is large)"
    PYTHON=$(command -v python3.11 || command -v python3)
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/pip" install -q -r "$ROOT/tests/fixtures/requirements.txt" gguf sentencepiece
fi

# --- 2. llama.cpp source and build ------------------------------------------
if [[ ! -f $LLAMA/CMakeLists.txt || ! -f $LLAMA/convert_hf_to_gguf.py ]]; then
    log "fetching llama.cpp from the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist"
    rm -rf "$DIR/dl" "$LLAMA"
    mkdir -p "$DIR/dl"
    "$VENV/bin/pip" download -q --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$DIR/dl"
    tar -xzf "$DIR/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$DIR/dl"
    mv "$DIR/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp" "$LLAMA"
    rm -rf "$DIR/dl"
fi
LLAMA_SERVER=$LLAMA/build/bin/llama-server
if [[ ! -x $LLAMA_SERVER || ! -x $LLAMA/build/bin/llama-bench ]]; then
    command -v cmake >/dev/null || { log "installing cmake"; apt-get install -y cmake >/dev/null; }
    log "building llama.cpp (llama-server, llama-bench; ~10 min on 2 cores)"
    (cd "$LLAMA" &&
        cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
            -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF >/dev/null &&
        nice -n 10 cmake --build build -j"$(nproc)" --target llama-server llama-bench >/dev/null)
fi

# --- 3. the bench model and its GGUFs ---------------------------------------
if [[ ! -f $MODEL/config.json ]]; then
    log "generating the bench model in $MODEL (4 layers, vocab 8192, bf16)"
    rm -rf "$MODEL.tmp"
    nice -n 10 "$PY" "$ROOT/scripts/make_bench_model.py" "$MODEL.tmp" --layers 4 --vocab 8192 >/dev/null
    mv "$MODEL.tmp" "$MODEL"
fi

# llama.cpp's converter refuses a BPE vocabulary whose pre-tokenizer it does not
# know by hash; the bench tokenizer uses Qwen2's regex, so answer `qwen2`.
convert() { # OUTTYPE OUTFILE
    [[ -f $2 ]] && return 0
    log "converting to $2"
    nice -n 10 "$PY" - "$LLAMA" "$MODEL" --outtype "$1" --outfile "$2.tmp" <<'PY' >"$2.log" 2>&1
import runpy, sys
src = sys.argv[1]
sys.path[0:0] = [src + "/gguf-py", src]
from conversion import base
orig = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return orig(self, tokenizer)
    except NotImplementedError:
        return "qwen2"
base.TextModel.get_vocab_base_pre = pre
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
PY
    mv "$2.tmp" "$2"
}
convert bf16 "$DIR/bench-bf16.gguf"
convert q8_0 "$DIR/bench-q8_0.gguf"

# --- 4. the epserve binary ---------------------------------------------------
if [[ ! -x $EPSERVE ]]; then
    log "building $EPSERVE (cargo build --release -p epserve)"
    (cd "$ROOT" && nice -n 10 cargo build --release -p epserve)
fi

# --- 5. the runs -------------------------------------------------------------
if [[ -n ${TABLE_FROM:-} ]]; then
    RUN=$TABLE_FROM
    SERVERS_RUN=
    LOAD_BEFORE='?'
else
    RUN=$DIR/runs/$(date +%Y%m%d-%H%M%S)
    SERVERS_RUN=$SERVERS
fi
mkdir -p "$RUN"
PIN=()
if command -v taskset >/dev/null && ((THREADS <= $(nproc))); then
    PIN=(taskset -c "0-$((THREADS - 1))")
fi
declare -A SERVER_PIDS=() SERVER_PORTS=()
stop_servers() {
    local srv pid
    for srv in "${!SERVER_PIDS[@]}"; do
        pid=${SERVER_PIDS[$srv]}
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
        unset "SERVER_PIDS[$srv]"
    done
}
trap stop_servers EXIT
trap 'exit 130' INT TERM

ports=("$PORT")
((PAIRED)) && ports+=($((PORT + 1)))
for p in "${ports[@]}"; do
    if curl -s -o /dev/null "http://127.0.0.1:$p/health"; then
        echo "error: something already listens on 127.0.0.1:$p (set PORT=...)" >&2
        exit 1
    fi
done

start_server() { # SERVER PORT
    local srv=$1 port=$2 cmd
    case $srv in
    epserve-bf16 | epserve-int8)
        # No prefix cache, as llama-server below: a row's prompts are fresh anyway.
        cmd=("${PIN[@]}" "$EPSERVE" serve --model "$MODEL" --host 127.0.0.1 --port "$port"
            --served-model-name "$NAME" --max-num-seqs 8 --max-model-len 4096
            --kv-cache-memory 1GiB --no-enable-prefix-caching)
        # shellcheck disable=SC2206 # flags split on spaces on purpose
        cmd+=(${EPSERVE_FLAGS:-})
        # shellcheck disable=SC2206
        [[ $srv == epserve-int8 ]] && cmd+=(${EPSERVE_INT8_FLAGS:---expert-dtype int8 --dense-dtype int8})
        RAYON_NUM_THREADS=$THREADS "${cmd[@]}" >"$RUN/$srv.log" 2>&1 &
        ;;
    llama-bf16 | llama-q8_0)
        # 8 slots of 1280 positions (512 + 512 fit); no prompt cache (as epserve
        # above, and the same prompts must not be served from a cache on a later run).
        cmd=("${PIN[@]}" "$LLAMA_SERVER" -m "$DIR/bench-${srv#llama-}.gguf" --host 127.0.0.1
            --port "$port" -t "$THREADS" -tb "$THREADS" --parallel 8 -c $((8 * 1280))
            --no-cache-prompt --cache-ram 0 --no-webui --alias "$NAME")
        # shellcheck disable=SC2206 # flags split on spaces on purpose
        cmd+=(${LLAMA_FLAGS:-})
        "${cmd[@]}" >"$RUN/$srv.log" 2>&1 &
        ;;
    *)
        echo "error: unknown server $srv (SERVERS: epserve-bf16 epserve-int8 llama-bf16 llama-q8_0)" >&2
        exit 1
        ;;
    esac
    local pid=$!
    SERVER_PIDS[$srv]=$pid
    SERVER_PORTS[$srv]=$port
    echo "${cmd[*]}" >"$RUN/$srv.cmd"
    local deadline=$(($(date +%s) + READY_TIMEOUT))
    until [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$port/health" || true) == 200 ]]; do
        if ! kill -0 "$pid" 2>/dev/null; then
            echo "error: $srv exited while loading; tail of $RUN/$srv.log:" >&2
            tail -n 20 "$RUN/$srv.log" >&2
            exit 1
        fi
        if (($(date +%s) > deadline)); then
            echo "error: $srv not ready after ${READY_TIMEOUT}s; see $RUN/$srv.log" >&2
            exit 1
        fi
        sleep 1
    done
    log "$srv ready on port $port; warm-up"
    bench "$srv" "$RUN/$srv-warmup.json" 128 16 1 2 999 >"$RUN/$srv-warmup.txt" 2>&1 ||
        log "warm-up failed, see $RUN/$srv-warmup.txt"
}

bench() { # SERVER OUT_JSON INPUT OUTPUT CONCURRENCY PROMPTS SEED [ARGS...]
    local srv=$1 out=$2 input=$3 output=$4 conc=$5 n=$6 seed=$7
    shift 7
    "$EPSERVE" bench serve --base-url "http://127.0.0.1:${SERVER_PORTS[$srv]}" --model "$MODEL" \
        --served-model-name "$NAME" \
        --dataset-name random --random-input-len "$input" --random-output-len "$output" \
        --num-prompts "$n" --max-concurrency "$conc" --seed "$seed" --ignore-eos \
        --temperature 0 --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50 \
        --disable-tqdm --no-connection-reuse --save-result "$out" "$@"
}

workload_lens() { # WORKLOAD -> "IN OUT PER_CONC"
    case $1 in
    quick) echo "128 64 $QUICK_PROMPTS_PER_CONC" ;;
    long) echo "512 512 $LONG_PROMPTS_PER_CONC" ;;
    *)
        echo "error: unknown workload $1 (quick, long)" >&2
        exit 1
        ;;
    esac
}

# One row on each of the given servers, in that order: the same prompts (seed) on
# each. Results: SERVER-WORKLOAD-cC.json, or .rK.json for round K when ROUNDS > 1.
row() { # ROUND WORKLOAD C SEED SERVER...
    local round=$1 w=$2 c=$3 seed=$4 input output per n srv base
    shift 4
    read -r input output per <<<"$(workload_lens "$w")"
    n=$((per * c))
    ((n >= MIN_PROMPTS)) || n=$MIN_PROMPTS
    for srv in "$@"; do
        base=$RUN/$srv-$w-c$c
        ((ROUNDS > 1)) && base=$base.r$round
        log "$srv $w ($input in / $output out) c=$c: $n prompts, round $round of $ROUNDS"
        bench "$srv" "$base.json" "$input" "$output" "$c" "$n" "$seed" --label "$srv" \
            >"$base.txt" 2>&1 || log "bench failed, see $base.txt"
    done
}

for w in $WORKLOADS; do workload_lens "$w" >/dev/null; done
if ((PAIRED)) && (($(wc -w <<<"$SERVERS_RUN") % 2)); then
    echo "error: PAIRED=1 takes SERVERS two by two (e.g. \"epserve-bf16 llama-bf16\"); set PAIRED=0" >&2
    exit 1
fi
log "results in $RUN"
LOAD_BEFORE=${LOAD_BEFORE:-$(cut -d' ' -f1-3 /proc/loadavg)}
# Each round's rows get fresh prompts: seeds 1, 2, ... in round 1, 101, 102, ... in
# round 2 (the same for every server, so the servers of a row see the same prompts).
if ((PAIRED)); then
    read -r -a run_list <<<"$SERVERS_RUN"
    for ((i = 0; i < ${#run_list[@]}; i += 2)); do
        a=${run_list[i]} b=${run_list[i + 1]}
        log "starting $a and $b"
        start_server "$a" "$PORT"
        start_server "$b" $((PORT + 1))
        k=0
        for round in $(seq 1 "$ROUNDS"); do
            seed=$(((round - 1) * 100))
            for w in $WORKLOADS; do
                for c in $CONCURRENCY; do
                    seed=$((seed + 1))
                    # Alternate which server goes first, so neither always
                    # follows the other's load.
                    if ((k++ % 2)); then row "$round" "$w" "$c" "$seed" "$b" "$a"; else
                        row "$round" "$w" "$c" "$seed" "$a" "$b"; fi
                done
            done
        done
        stop_servers
    done
else
    for srv in $SERVERS_RUN; do
        log "starting $srv"
        start_server "$srv" "$PORT"
        for round in $(seq 1 "$ROUNDS"); do
            seed=$(((round - 1) * 100))
            for w in $WORKLOADS; do
                for c in $CONCURRENCY; do
                    seed=$((seed + 1))
                    row "$round" "$w" "$c" "$seed" "$srv"
                done
            done
        done
        stop_servers
    done
fi

# --- 6. the table --------------------------------------------------------------
{
    echo "epserve ${EPSERVE_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')} vs llama.cpp" \
        "(llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist) on $(lscpu | sed -n 's/^Model name: *//p' | head -n 1)," \
        "$THREADS threads, $(date -u +%Y-%m-%d);" \
        "$(if [[ -n ${TABLE_FROM:-} ]]; then echo "earlier results from $RUN (their run order unknown here)"
        elif ((PAIRED)); then echo "each precision's two servers loaded at once, rows run back to back on both, $ROUNDS round(s)"
        else echo "one server at a time, $ROUNDS round(s)"; fi);" \
        "load average $LOAD_BEFORE before the runs," \
        "$(cut -d' ' -f1-3 /proc/loadavg) after; $(($(date +%s) - START)) s in all"
    echo
    "$PY" - "$RUN" "$WORKLOADS" "$CONCURRENCY" "$SERVERS" <<'PY'
import json, sys
from pathlib import Path
run, workloads, concs, servers = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split(), sys.argv[4].split()
label = {"epserve-bf16": "epserve serve, bf16", "llama-bf16": "llama.cpp BF16",
         "epserve-int8": "epserve serve, int8 (`EPSERVE_INT8_FLAGS`)", "llama-q8_0": "llama.cpp Q8_0"}
peer = {"epserve-bf16": "llama-bf16", "epserve-int8": "llama-q8_0"}
lens = {"quick": "128/64", "long": "512/512"}
def rounds(srv, w, c):
    """{round: result} of one row: round 1 alone when run without ROUNDS."""
    out = {}
    one = run / f"{srv}-{w}-c{c}.json"
    if one.exists():
        out[1] = json.loads(one.read_text())
    for f in run.glob(f"{srv}-{w}-c{c}.r*.json"):
        out[int(f.name.rsplit(".r", 1)[1].split(".")[0])] = json.loads(f.read_text())
    return out
def med(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    h = len(xs) // 2
    return xs[h] if len(xs) % 2 else (xs[h - 1] + xs[h]) / 2
def fmt(x, d=1):
    return "-" if x is None else f"{x:.{d}f}"
print("| workload (in/out) | c | server | out tok/s | TTFT p50 ms | TPOT p50 ms | tok/s ratio | TTFT ratio | TPOT ratio |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
notes = []
nrounds = 1
for w in workloads:
    for c in concs:
        for s in servers:
            rs = rounds(s, w, c)
            if not rs:
                ran = (run / f"{s}-{w}-c{c}.txt").exists() or any(run.glob(f"{s}-{w}-c{c}.r*.txt"))
                print(f"| {w} ({lens[w]}) | {c} | {label.get(s, s)} | {'failed' if ran else 'not run'} | | | | | |")
                continue
            nrounds = max(nrounds, len(rs))
            mark = ""
            for k, r in sorted(rs.items()):
                want = r["num_prompts"] * int(lens[w].split("/")[1])
                if r.get("failed") or r["total_output_tokens"] != want:
                    mark = " ⚠"
                    notes.append(f"{s} {w} c={c} round {k}: {r['completed']} completed, {r.get('failed', 0)} failed, "
                                 f"{r['total_output_tokens']} output tokens (expected {want})")
            keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms")
            m = {key: med(r.get(key) for r in rs.values()) for key in keys}
            ratios = ["", "", ""]
            ps = rounds(peer[s], w, c) if s in peer else {}
            if ps:
                def ratio(key):
                    # Paired by round: each round's ratio, then their median (and range).
                    rr = [rs[k][key] / ps[k][key] for k in rs if k in ps and rs[k].get(key) and ps[k].get(key)]
                    if not rr:
                        return "-"
                    if len(rr) == 1:
                        return f"{rr[0]:.2f}x"
                    return f"{med(rr):.2f}x ({min(rr):.2f}-{max(rr):.2f})"
                ratios = [ratio(key) for key in keys]
            print(f"| {w} ({lens[w]}) | {c} | {label.get(s, s)} | {fmt(m['output_throughput'])}{mark} "
                  f"| {fmt(m['median_ttft_ms'], 0)} | {fmt(m['median_tpot_ms'])} | " + " | ".join(ratios) + " |")
print()
def prompts(w, c):
    rs = rounds(servers[0], w, c)
    return next(iter(rs.values()))["num_prompts"] if rs else None
print("Ratios are epserve / llama.cpp at the same precision (bf16 vs BF16, epserve int8 vs Q8_0; EPSERVE_INT8_FLAGS defaults to int8 experts and dense projections): "
      "above 1 is better for tok/s, below 1 is better for TTFT and TPOT. "
      + (f"Figures are medians over {nrounds} rounds; each ratio is the median of the rounds' ratios (their range in brackets). " if nrounds > 1 else "")
      + f"Prompts per run: {', '.join(f'{w} c={c}: {prompts(w, c)}' for w in workloads for c in concs if prompts(w, c))}.")
for n in notes:
    print(f"- ⚠ {n}")
PY
} | tee "$RESULT"
log "done; table in $RESULT, raw results in $RUN"
