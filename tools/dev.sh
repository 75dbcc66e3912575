#!/usr/bin/env bash
# One entry point that sets everything up on a fresh machine, then runs:
#   bash tools/dev.sh example   # the main example (an MLP trained on digits)
#   bash tools/dev.sh test      # the test suite (style, the Bazel build and the wheel check first)
#   bash tools/dev.sh wheel     # build the wheel and install it into a fresh virtualenv
# Set-up is idempotent: a virtualenv, the pinned packages (reinstalled only
# when the requirement files change), then the package built in place.
#
# TDX_TORCH_XLA=2.7|2.8|2.9 (default 2.9) picks the torch_xla release, each
# with its own torch and its own virtualenv (.venv for 2.9, .venv-2.8, ...);
# tools/test_releases.sh runs the suite on every one.
set -euo pipefail
cd "$(dirname "$0")/.."

RELEASE=${TDX_TORCH_XLA:-2.9}
PINS="requirements/torch_xla-$RELEASE.txt"
if [ ! -f "$PINS" ]; then
  echo "dev.sh: TDX_TORCH_XLA=$RELEASE is not a supported release (2.7, 2.8, 2.9)" >&2
  exit 2
fi
if [ "$RELEASE" = 2.9 ]; then DEFAULT_VENV=.venv; else DEFAULT_VENV=.venv-$RELEASE; fi
VENV=${TDX_VENV:-$DEFAULT_VENV}
PY="$VENV/bin/python"

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.requirements.sha"
  local want
  want=$(cat "$PINS" requirements/common.txt | sha256sum | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "dev.sh: installing torch_xla $RELEASE and the requirements into $VENV (torch alone is several GB)" >&2
    pip_quiet install -r "$PINS" -r requirements/common.txt
    echo "$want" > "$stamp"
  fi
  # --no-build-isolation: the build must see the installed pybind11 and must
  # not pull its own torch (several GB) into an isolated environment.
  pip_quiet install --no-build-isolation --no-deps -e .
}

# pip, with its chatter kept in a log that is shown only when it fails.
pip_quiet() {
  local log="$VENV/pip.log"
  if ! "$PY" -m pip --disable-pip-version-check "$@" > "$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" | tail -40 >&2
    echo "dev.sh: pip $* failed (full log: $log)" >&2
    return 1
  fi
}

export PJRT_DEVICE=${PJRT_DEVICE:-CPU}

case "${1:-}" in
  example)
    setup
    shift
    exec "$PY" examples/train_digits.py "$@"
    ;;
  test)
    setup
    shift
    bash tools/lint.sh "$PY"
    case "$PY" in /*) abs_py=$PY ;; *) abs_py=$PWD/$PY ;; esac  # TDX_VENV may be absolute
    PYTHON_BIN_PATH="$abs_py" bash tools/bazel_build.sh
    bash tools/check_wheel.sh "$PY"
    exec "$PY" -m pytest test "$@"
    ;;
  wheel)
    setup
    exec bash tools/check_wheel.sh "$PY"
    ;;
  *)
    echo "usage: [TDX_TORCH_XLA=2.7|2.8|2.9] bash tools/dev.sh example|test|wheel [args...]" >&2
    exit 2
    ;;
esac
