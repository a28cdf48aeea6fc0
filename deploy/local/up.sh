#!/usr/bin/env bash
# Start the local prefill/decode cluster (default 1P2D) on 127.0.0.1 and send
# one request through the router. Sets up .venv with the transport extras
# first (nixl, mooncake-transfer-engine-non-cuda, vllm-router; Debian's
# libibverbs1 when run as root). Arguments go to
# `python -m vllm_mooncake.tools.cluster.local up`, e.g.
#   deploy/local/up.sh --shape 2p2d --base-port 21000
#   MODEL=/models/Llama-3.1-8B-Instruct EXTRAS=cuda,transport deploy/local/up.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
EXTRAS=${EXTRAS:-cpu,test,sim,transport} scripts/bootstrap.sh
export VLLM_MOONCAKE_CACHE=${VLLM_MOONCAKE_CACHE:-$PWD/.cache}
exec .venv/bin/python -m vllm_mooncake.tools.cluster.local up "$@"
