#!/usr/bin/env bash
# Cross-builds epserve-core's kernel tests for aarch64-unknown-linux-gnu and
# runs them under qemu-aarch64 twice: with `-cpu max` (NEON, dotprod, bf16, i8mm,
# SVE: every aarch64 tier runs, neon-bf16 included) and with `-cpu neoverse-n1`
# (NEON + dotprod only: the fallbacks run and the missing tiers are listed as
# SKIPPED). Called from .ci/run.
#
# Needs: rustup target aarch64-unknown-linux-gnu, Debian's gcc-aarch64-linux-gnu,
# libc6-dev-arm64-cross and qemu-user. With --install it apt-installs them.
# If anything is missing it says so loudly and exits 2 (set
# EPSERVE_AARCH64_OPTIONAL=1 to exit 0 instead, e.g. on a machine without apt).
set -euo pipefail
cd "$(dirname "$0")/.."

TARGET=aarch64-unknown-linux-gnu
SYSROOT=/usr/aarch64-linux-gnu

loud() {
    echo "########################################################################" >&2
    echo "## test-aarch64: $*" >&2
    echo "########################################################################" >&2
}

missing() {
    loud "$1 -- the aarch64 kernels were NOT tested"
    if [[ "${EPSERVE_AARCH64_OPTIONAL:-0}" == 1 ]]; then exit 0; fi
    exit 2
}

if [[ "${1:-}" == "--install" ]]; then
    if command -v apt-get >/dev/null; then
        apt-get update -qq
        apt-get install -y -qq gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user >/dev/null
    fi
fi

if ! rustup target list --installed 2>/dev/null | grep -qx "$TARGET"; then
    rustup target add "$TARGET" || missing "cannot add the Rust target $TARGET (rustup target add failed)"
fi
command -v aarch64-linux-gnu-gcc >/dev/null || missing "aarch64-linux-gnu-gcc not found (apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross)"
command -v qemu-aarch64 >/dev/null || missing "qemu-aarch64 not found (apt-get install qemu-user)"
[[ -d "$SYSROOT" ]] || missing "$SYSROOT not found (apt-get install libc6-dev-arm64-cross)"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
# Only the kernel, expert-executor and dense-linear unit tests: cheap under
# emulation.
FILTERS=(kernels experts model::linear)

for cpu in max neoverse-n1; do
    echo "== aarch64 kernel tests under qemu-aarch64 -cpu $cpu"
    export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -cpu $cpu -L $SYSROOT"
    # One emulated run per cpu (libtest takes several filters); its output
    # goes to a log so the exit status is cargo's own, then the lines that
    # matter are shown.
    log=$(mktemp)
    rc=0
    # The cross-test profile (Cargo.toml): dependencies at opt-level 1, no
    # debug info; the build was most of this script's time.
    cargo test -p epserve-core --lib --target "$TARGET" --profile cross-test \
        -- --nocapture "${FILTERS[@]}" >"$log" 2>&1 || rc=$?
    grep -E "tiers under test|SKIPPED|^test |test result|panicked|error" "$log" || true
    if [[ $rc != 0 ]]; then
        tail -n 40 "$log" >&2
        rm -f "$log"
        loud "aarch64 tests failed (cpu $cpu, exit status $rc)"
        exit 1
    fi
    rm -f "$log"
done
echo "== aarch64 kernel tests passed on qemu cpus: max, neoverse-n1"
