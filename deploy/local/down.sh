#!/usr/bin/env bash
# Stop exactly the processes deploy/local/up.sh started (recorded in
# .cache/deploy/<run>/state.json). Arguments: [--run NAME].
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ ! -x .venv/bin/python ]; then
  echo "[down] no .venv: nothing was started" >&2
  exit 0
fi
export VLLM_MOONCAKE_CACHE=${VLLM_MOONCAKE_CACHE:-$PWD/.cache}
exec .venv/bin/python -m vllm_mooncake.tools.cluster.local down "$@"
