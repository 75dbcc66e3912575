#!/usr/bin/env bash
# Builds the wheel and proves it installs and works on its own:
#   bash tools/check_wheel.sh [PYTHON]   (default: .venv/bin/python)
# PYTHON's environment must have torch, torch_xla, pybind11, setuptools and
# wheel (tools/dev.sh sets one up).  The wheel is built without isolation
# (the extension's ABI follows the installed torch), then installed into a
# fresh virtualenv that sees PYTHON's torch and torch_xla through a .pth file
# (no second multi-GB download) but not this checkout, and imported from
# outside it to run one donation.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT

"$PY" -m pip --disable-pip-version-check wheel -q --no-build-isolation --no-deps . -w "$TMP/dist" \
  > "$TMP/build.log" 2>&1 || { tail -30 "$TMP/build.log"; exit 1; }
WHEEL=$(ls "$TMP"/dist/torch_xla_donate-*.whl)
python3 -m venv "$TMP/venv"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
FRESH=$("$TMP/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$SITE" > "$FRESH/dev-environment.pth"   # torch and torch_xla, nothing of ours
"$TMP/venv/bin/python" -m pip --disable-pip-version-check install -q --no-deps "$WHEEL" \
  2>&1 | grep -v "^WARNING: Location" || true
cd "$TMP"
PJRT_DEVICE=${PJRT_DEVICE:-CPU} "$TMP/venv/bin/python" - "$FRESH" <<'PYEOF'
import sys, warnings
warnings.simplefilter("ignore", DeprecationWarning)
import torch, torch_xla
import torch_xla_donate as tdx
assert tdx.__file__.startswith(sys.argv[1]), f"imported {tdx.__file__}, not the wheel's copy"
dev = torch_xla.device()
p, g = torch.ones(64, 64, device=dev), torch.ones(64, 64, device=dev)
torch_xla.sync()
tdx.donate_buffer(p)
new = p * 0.5 + g
torch_xla.sync(wait=True)
assert tdx.is_deleted(p) and new.sum().item() == 1.5 * 64 * 64
print(f"check_wheel: torch_xla_donate {tdx.__version__} from the wheel, on torch_xla "
      f"{torch_xla.__version__}: a donation consumed, the result right")
PYEOF
