#!/usr/bin/env bash
# Installs what building and testing epserve needs beyond a Rust toolchain,
# when missing: protoc (the etcd-client crate generates code at build time)
# and etcd (the cluster runs and is tested against a real one). Debian/Ubuntu.
set -euo pipefail
need=()
command -v protoc >/dev/null || need+=(protobuf-compiler)
command -v etcd >/dev/null || need+=(etcd-server)
command -v etcdctl >/dev/null || need+=(etcd-client)
if [ ${#need[@]} -gt 0 ]; then
    echo "installing: ${need[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}"
fi
