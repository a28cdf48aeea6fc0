#!/usr/bin/env bash
# What deploy/local/up.sh started: pid, live processes, health, log file.
set -euo pipefail
cd "$(dirname "$0")/../.."
export VLLM_MOONCAKE_CACHE=${VLLM_MOONCAKE_CACHE:-$PWD/.cache}
exec .venv/bin/python -m vllm_mooncake.tools.cluster.local status "$@"
