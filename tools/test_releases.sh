#!/usr/bin/env bash
# Runs the whole suite on every supported torch_xla release, each in its own
# virtualenv (set up on first use, several GB each), and prints a table:
#   bash tools/test_releases.sh [2.7 2.8 2.9] [-- pytest args]
# Logs: out/releases/<release>.log.  Exits non-zero if any release failed.
set -uo pipefail
cd "$(dirname "$0")/.."
RELEASES=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do RELEASES+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#RELEASES[@]} -eq 0 ] && RELEASES=(2.7 2.8 2.9)
mkdir -p out/releases
status=0
rows=()
for r in "${RELEASES[@]}"; do
  log="out/releases/$r.log"
  start=$SECONDS
  TDX_TORCH_XLA=$r bash tools/dev.sh test -q -p no:cacheprovider "$@" > "$log" 2>&1
  rc=$?
  [ $rc -ne 0 ] && status=1
  summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)" "$log" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
  venv=.venv; [ "$r" != 2.9 ] && venv=.venv-$r
  versions=$("$venv/bin/python" -c 'import torch, torch_xla; print(f"torch {torch.__version__}, torch_xla {torch_xla.__version__}")' 2>/dev/null)
  rows+=("| $r | ${versions:-?} | ${summary:-no summary, exit $rc (see $log)} | $(( (SECONDS - start) / 60 )) min |")
done
# The checkout's extension is built in place for the release set up last:
# leave it built for the default one.
if [ "${RELEASES[${#RELEASES[@]}-1]}" != 2.9 ]; then
  bash tools/dev.sh wheel > out/releases/rebuild-default.log 2>&1 || status=1
fi
echo "| release | installed | pytest | time |"
echo "| --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
exit $status
