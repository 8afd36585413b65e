#!/usr/bin/env bash
# The test command (README): installs what the tests need, then runs every
# test of the workspace — unit tests, transformers goldens for every fixture,
# the CLI, the OpenAI server (with the official openai Python client) and the
# cluster on loopback with a real etcd.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
if ! python3 -c "import openai" 2>/dev/null; then
    python3 -m pip install --quiet --disable-pip-version-check openai
fi
export EPSERVE_REQUIRE_OPENAI=1 EPSERVE_REQUIRE_ETCD=1
cargo test --workspace
# The sampler's streaming passes are built per vector extension and chosen by
# the kernel tier: run its tests on the baseline build too. `--workspace`, as
# above: `-p epserve-core` alone resolves its dependencies' features apart
# from the workspace's and rebuilds them all (minutes of the CI budget).
EPSERVE_KERNEL=generic cargo test --workspace --lib sampling
