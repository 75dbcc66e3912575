#!/usr/bin/env bash
# Build and test torch_xla_donate with Bazel, offline.
#
#   bash tools/bazel_build.sh
#
# 1. Installs Debian's bazel-bootstrap (Bazel 4) with apt-get if there is no
#    bazel (needs root or sudo; only the Debian archive is contacted).
# 2. bazel build //... and bazel test //... : the extension
#    torch_xla_donate._C (bazel-bin/torch_xla_donate/_C.so), the py_library
#    //:torch_xla_donate and the smoke tests.  Nothing is downloaded: see
#    WORKSPACE and third_party/bazel/.
# 3. Imports the built torch_xla_donate._C from bazel-bin with the configured
#    Python and calls _C.current_step().
#
# Environment (all optional):
#   PYTHON_BIN_PATH         Python whose headers, pybind11 and site-packages
#                           are used, and which runs the tests.  Default:
#                           <repo>/.venv/bin/python if it exists, else python3.
#   BAZEL                   bazel command (default: bazel).
#   BAZEL_OUTPUT_BASE       Bazel output base (default:
#                           /tmp/bazel-torch_xla_donate-<hash of repo path>).
#   BAZEL_JOBS              --jobs (default: 2).
#   BAZEL_COMPILATION_MODE  -c: opt, fastbuild or dbg (default: opt).
#   BAZEL_EXPUNGE=1         bazel clean --expunge first (a cold build).
#   BAZEL_BATCH=1           run Bazel with --batch (no server left behind;
#                           slower).  Otherwise the server exits after
#                           BAZEL_MAX_IDLE_SECS (default: 300) idle seconds.
#   BAZEL_EXTRA_ARGS        more flags for bazel build / test (word-split).
#
# Exits non-zero if anything fails.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

log() { printf '[bazel_build] %s\n' "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }

# --- Python --------------------------------------------------------------
if [[ -z "${PYTHON_BIN_PATH:-}" ]]; then
  if [[ -x "$REPO/.venv/bin/python" ]]; then
    PYTHON_BIN_PATH="$REPO/.venv/bin/python"
  else
    PYTHON_BIN_PATH="python3"
  fi
fi
if [[ "$PYTHON_BIN_PATH" != */* ]]; then
  resolved="$(command -v "$PYTHON_BIN_PATH" || true)"
  [[ -n "$resolved" ]] || die "PYTHON_BIN_PATH=$PYTHON_BIN_PATH is not on PATH"
  PYTHON_BIN_PATH="$resolved"
fi
[[ -x "$PYTHON_BIN_PATH" ]] || die "PYTHON_BIN_PATH=$PYTHON_BIN_PATH is not executable"
PYTHON_BIN_PATH="$(cd "$(dirname "$PYTHON_BIN_PATH")" && pwd)/$(basename "$PYTHON_BIN_PATH")"
export PYTHON_BIN_PATH

# --- Bazel ---------------------------------------------------------------
BAZEL="${BAZEL:-bazel}"
if ! command -v "$BAZEL" >/dev/null 2>&1; then
  [[ "$BAZEL" == bazel ]] || die "BAZEL=$BAZEL not found"
  log "bazel not found: installing Debian's bazel-bootstrap"
  command -v apt-get >/dev/null 2>&1 || die "no bazel and no apt-get to install it"
  SUDO=()
  if [[ "$(id -u)" != 0 ]]; then
    command -v sudo >/dev/null 2>&1 || die "installing bazel-bootstrap needs root or sudo"
    SUDO=(sudo)
  fi
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -q
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q bazel-bootstrap
  command -v "$BAZEL" >/dev/null 2>&1 || die "bazel-bootstrap installed no bazel"
fi

if [[ -z "${BAZEL_OUTPUT_BASE:-}" ]]; then
  BAZEL_OUTPUT_BASE="/tmp/bazel-torch_xla_donate-$(printf '%s' "$REPO" | md5sum | cut -c1-12)"
fi
JOBS="${BAZEL_JOBS:-2}"
MODE="${BAZEL_COMPILATION_MODE:-opt}"

STARTUP=(--output_base="$BAZEL_OUTPUT_BASE")
if [[ "${BAZEL_BATCH:-0}" == 1 ]]; then
  STARTUP+=(--batch)
else
  STARTUP+=(--max_idle_secs="${BAZEL_MAX_IDLE_SECS:-300}")
fi
# shellcheck disable=SC2206  # word splitting is intended
FLAGS=(
  --jobs="$JOBS"
  --compilation_mode="$MODE"
  --repo_env=PYTHON_BIN_PATH="$PYTHON_BIN_PATH"
  --test_output=errors
  --nosandbox_debug
  ${BAZEL_EXTRA_ARGS:-}
)

bz() { "$BAZEL" "${STARTUP[@]}" "$@"; }

log "repo:        $REPO"
log "python:      $PYTHON_BIN_PATH"
log "bazel:       $(command -v "$BAZEL")"
log "output base: $BAZEL_OUTPUT_BASE (jobs=$JOBS, -c $MODE)"

if [[ "${BAZEL_EXPUNGE:-0}" == 1 ]]; then
  log "bazel clean --expunge"
  bz clean --expunge
fi

t0=$SECONDS
log "bazel build //..."
bz build "${FLAGS[@]}" //...
t1=$SECONDS
log "bazel test //..."
bz test "${FLAGS[@]}" //...
t2=$SECONDS

# --- The built extension imports from bazel-bin ---------------------------
BAZEL_BIN="$(bz info "${FLAGS[@]}" bazel-bin)"
SO="$BAZEL_BIN/torch_xla_donate/_C.so"
[[ -f "$SO" ]] || die "$SO was not built"
log "importing torch_xla_donate._C from $BAZEL_BIN"
# A bare parent package pointing at bazel-bin/torch_xla_donate: the import
# must find the Bazel-built _C.so, not a source checkout or installed copy
# (and must not run torch_xla_donate/__init__.py, which imports torch_xla).
"$PYTHON_BIN_PATH" - "$BAZEL_BIN" <<'EOF'
import importlib, os, sys, types
bazel_bin = sys.argv[1]
sys.path.insert(0, bazel_bin)
package_dir = os.path.join(bazel_bin, "torch_xla_donate")
parent = types.ModuleType("torch_xla_donate")
parent.__path__ = [package_dir]
sys.modules["torch_xla_donate"] = parent
C = importlib.import_module("torch_xla_donate._C")
expected = os.path.realpath(os.path.join(package_dir, "_C.so"))
if os.path.realpath(C.__file__) != expected:
    sys.exit("imported %s, expected %s" % (C.__file__, expected))
if "torch" in sys.modules:
    sys.exit("importing _C imported torch")
step = C.current_step()
if not isinstance(step, int):
    sys.exit("_C.current_step() returned %r" % (step,))
print("torch_xla_donate._C OK: %s, current_step() = %d" % (C.__file__, step))
EOF
t3=$SECONDS

log "OK: build $((t1 - t0))s, test $((t2 - t1))s, import check $((t3 - t2))s, total $((t3 - t0))s"
