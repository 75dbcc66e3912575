"""Mutation testing by hand: does each promise have a test that fails when
it breaks?

Each mutant (tools/mutant_catalogue.py) replaces one exact snippet of the
package (Python, or C++ under csrc/, then rebuilt) in a throw-away copy of
this worktree and runs the test files that guard that decision there, with
``-x -q`` and a timeout.  A test run that still passes means the mutant
*survived*: no test can see that decision break.  Shipped code is never
touched; the copy lives under the system's temporary directory and is
removed afterwards (``--keep`` leaves it).

    python tools/mutants.py --list                 # names, files, what each breaks
    python tools/mutants.py --run poison-skip      # one mutant (or several, or --all)
    python tools/mutants.py --all                  # every mutant, one pytest at a time
    python tools/mutants.py --all --no-native      # without the C++ ones (no rebuilds)
    python tools/mutants.py --baseline poison-skip # its tests on the unmutated copy

Slow (each run starts torch_xla; a C++ mutant rebuilds the extension, about
a minute), so it is no part of CI: run it after changing a decision or its
tests.  Exit status 1 if any mutant survived or could not be applied.
tools/MUTANTS.md has the last results.
"""
import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mutant_catalogue import MUTANTS  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT = 900  # seconds per mutant's test run


def _worktree_files() -> list:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, check=True, capture_output=True)
    return [p for p in out.stdout.decode().split("\0") if p]


def make_copy(dest: str) -> None:
    """The worktree's files as they are now (edits and new files included,
    ignored ones not) and its built extension, in ``dest``."""
    for rel in _worktree_files():
        src = os.path.join(ROOT, rel)
        if not os.path.isfile(src):
            continue  # deleted in the work tree
        os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
        shutil.copy2(src, os.path.join(dest, rel))
    pkg = os.path.join(ROOT, "torch_xla_donate")
    built = [f for f in os.listdir(pkg) if f.startswith("_C") and f.endswith(".so")]
    if not built:
        sys.exit("no built extension: run `python setup.py build_ext --inplace` first")
    for f in built:
        shutil.copy2(os.path.join(pkg, f), os.path.join(dest, "torch_xla_donate", f))


def apply(mutant: dict, dest: str) -> None:
    """Replaces the mutant's snippet in the copy; it must occur exactly once
    (else the catalogue is stale: the code moved on)."""
    path = os.path.join(dest, mutant["file"])
    with open(path) as f:
        text = f.read()
    count = text.count(mutant["old"])
    if count != 1:
        raise LookupError(f"{mutant['file']}: snippet found {count} times, expected once "
                          f"(update the catalogue)")
    with open(path, "w") as f:
        f.write(text.replace(mutant["old"], mutant["new"]))


def rebuild(dest: str) -> None:
    proc = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"],
                          cwd=dest, capture_output=True, text=True, timeout=TIMEOUT)
    if proc.returncode != 0:
        raise RuntimeError("the mutated extension does not build:\n" + proc.stderr[-3000:])


def run_tests(mutant: dict, dest: str) -> tuple:
    """Runs the mutant's tests in ``dest``, one pytest after another, stopping
    at the first failure: (verdict, detail)."""
    env = dict(os.environ, PJRT_DEVICE="CPU")
    env.pop("PYTHONPATH", None)
    for spec in mutant["tests"]:
        args = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                *shlex.split(spec)]
        try:
            proc = subprocess.run(args, cwd=dest, env=env, capture_output=True, text=True,
                                  timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return "killed", f"{spec}: timed out after {TIMEOUT} s"
        tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
        if proc.returncode == 1:
            failed = [ln for ln in proc.stdout.splitlines() if ln.startswith("FAILED")]
            return "killed", (failed[0] if failed else tail[0])
        if proc.returncode not in (0, 1):
            return "error", f"{spec}: pytest exit {proc.returncode}: {tail[0]}"
    return "survived", tail[0]


def run_one(mutant: dict, keep: bool, baseline: bool) -> tuple:
    dest = tempfile.mkdtemp(prefix=f"tdx-mutant-{mutant['name']}-")
    try:
        make_copy(dest)
        if not baseline:
            apply(mutant, dest)
            if mutant["file"].startswith("csrc/"):
                rebuild(dest)
        return run_tests(mutant, dest)
    except (LookupError, RuntimeError) as error:
        return "error", str(error)
    finally:
        if keep:
            print(f"  copy kept: {dest}")
        else:
            shutil.rmtree(dest, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants")
    parser.add_argument("--run", nargs="+", metavar="NAME", help="run these mutants")
    parser.add_argument("--all", action="store_true", help="run every mutant")
    parser.add_argument("--baseline", nargs="+", metavar="NAME",
                        help="run these mutants' tests without the mutation (must pass)")
    parser.add_argument("--keep", action="store_true", help="keep the mutated copies")
    parser.add_argument("--no-native", action="store_true",
                        help="leave out the C++ mutants (each rebuilds the extension)")
    opts = parser.parse_args()
    by_name = {m["name"]: m for m in MUTANTS}
    if opts.list or not (opts.run or opts.all or opts.baseline):
        stale = 0
        for m in MUTANTS:
            with open(os.path.join(ROOT, m["file"])) as f:
                found = f.read().count(m["old"])
            stale += found != 1
            flag = "" if found == 1 else f"  [STALE: snippet found {found} times]"
            print(f"{m['name']:28} {m['file']:42} {m['what']}{flag}")
        return 1 if stale else 0
    names = list(by_name) if opts.all else (opts.run or opts.baseline)
    if opts.no_native:
        names = [n for n in names if not by_name.get(n, {"file": ""})["file"].startswith("csrc/")]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        parser.error(f"unknown mutant(s): {', '.join(unknown)} (see --list)")
    bad = 0
    for name in names:
        start = time.monotonic()
        verdict, detail = run_one(by_name[name], opts.keep, bool(opts.baseline))
        if opts.baseline:
            verdict = {"survived": "passes", "killed": "FAILS"}.get(verdict, verdict)
            bad += verdict != "passes"
        else:
            bad += verdict != "killed"
        print(f"{name:28} {verdict:8} {time.monotonic() - start:6.0f} s  {detail}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
