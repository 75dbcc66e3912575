#!/usr/bin/env bash
# The style checks the test command runs first (tools/dev.sh test):
#   ruff      lint and import order of every Python file (pyproject.toml)
#   clang-format   the C++ of csrc/ (.clang-format)
#   bash tools/lint.sh [PYTHON]        (default: .venv/bin/python)
# To fix what they report: ruff check --fix . ; clang-format -i csrc/**/*.{h,cpp}
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
BIN=$(dirname "$PY")
"$BIN/ruff" check --quiet .
mapfile -t CPP < <(git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/**/*.cpp' 'csrc/**/*.h' | sort -u)
"$BIN/clang-format" --dry-run -Werror "${CPP[@]}"
echo "lint: ruff and clang-format clean (${#CPP[@]} C++ files)"
