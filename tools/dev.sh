#!/usr/bin/env bash
# One entry point that sets everything up on a fresh machine, then runs:
#   bash tools/dev.sh example   # the main example (an MLP trained on digits)
#   bash tools/dev.sh test      # the test suite (and the Bazel build)
# Set-up is idempotent: a virtualenv in .venv, the pinned packages (reinstalled
# only when requirements.txt changes), then the package built in place.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${TDX_VENV:-.venv}
PY="$VENV/bin/python"

setup() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  local stamp="$VENV/.requirements.sha"
  local want
  want=$(sha256sum requirements.txt | cut -d' ' -f1)
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "dev.sh: installing requirements into $VENV (torch alone is several GB)" >&2
    pip_quiet install -r requirements.txt
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
    PYTHON_BIN_PATH="$PWD/$PY" bash tools/bazel_build.sh
    exec "$PY" -m pytest test "$@"
    ;;
  *)
    echo "usage: bash tools/dev.sh example|test [args...]" >&2
    exit 2
    ;;
esac
