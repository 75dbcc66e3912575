"""XLA:CPU's XNNPACK switched off at import (torch_xla_donate/_xla_cpu.py).

Each case runs in a fresh interpreter: XLA reads ``XLA_FLAGS`` once, when
torch_xla's runtime starts.  Evidence that XLA took the flag is the dump of
the debug options a compiled graph was built with (XLA writes the options
that differ from its defaults next to the HLO).
"""
import glob
import json
import os

import pytest
import torch_xla
from helpers import run_python

from torch_xla_donate import _native as compat
from torch_xla_donate import _xla_cpu as xla_cpu

# torch_xla 2.9's XLA:CPU has XNNPACK on by default, 2.7's and 2.8's off.
ON_BY_DEFAULT = xla_cpu.on_by_default(torch_xla.__version__)
# ... and from 2.8 on, XLA dumps the options a graph was compiled with.
DUMPS_OPTIONS = compat.release(torch_xla.__version__) >= (2, 8)

# Prints a JSON line: what the import decided, XLA_FLAGS after it, the
# StaleReadWarnings of two donations and the debug options of the graphs.
_PROBE = """
import json, glob, logging, os, sys, warnings
records = []
class Keep(logging.Handler):
    def emit(self, record): records.append(record.getMessage())
log = logging.getLogger("torch_xla_donate")
log.addHandler(Keep()); log.setLevel(logging.INFO)
import torch, torch_xla
if {start_runtime}:
    torch.ones(2, device=torch_xla.device()).cpu()
import torch_xla_donate as tdx
from torch_xla_donate import _C
{after_import}
dev = torch_xla.device()
a = torch.ones(8, device=dev) * 2; b = torch.ones(8, device=dev) * 3
torch_xla.sync()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    tdx.donate_buffer(a)
    fast = _C.try_mark(b) == 0    # marks only once the warning was given
    a2 = a + 1; b2 = b + 1
    torch_xla.sync()
stale = [str(w.message) for w in caught if issubclass(w.category, tdx.StaleReadWarning)]
option_files = glob.glob(os.path.join({dump!r}, "*.debug_options"))
options = "".join(open(f).read() for f in option_files)
from torch_xla_donate import _xla_cpu as xla_cpu
print(json.dumps({{"state": xla_cpu.state(), "flags": os.environ.get("XLA_FLAGS", ""),
                  "stale": stale, "fast": fast, "log": records,
                  "reused": [tdx.is_deleted(a), tdx.is_deleted(b)], "dumped": bool(option_files),
                  "summary": str(tdx.summary()), "metrics": tdx.metrics_report(),
                  "listed": sorted({{line.strip() for line in options.splitlines()
                                    if "xla_cpu_use_xnnpack" in line}})}}))
"""


def _probe(tmp_path, xla_flags="", start_runtime=False, after_import="", **env):
    dump = str(tmp_path / "dump")
    flags = f"{xla_flags} --xla_dump_to={dump}".strip()
    proc = run_python(_PROBE.format(start_runtime=start_runtime, dump=dump,
                                    after_import=after_import.format(dump=dump)),
                      env=dict(env, XLA_FLAGS=flags))
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # XLA dumps the options that differ from its defaults: XNNPACK ran off
    # if the graphs say so, or say nothing where off is the default.
    out["xnnpack_off"] = (out["listed"] == ["xla_cpu_use_xnnpack: false"]
                          or (out["listed"] == [] and not ON_BY_DEFAULT))
    if not out["dumped"]:
        # torch_xla 2.7's XLA writes no options file: no evidence either way.
        assert not DUMPS_OPTIONS, "XLA wrote no debug options for the graphs"
        out["xnnpack_off"] = None
    return out


def test_cpu_process_gets_the_flag_before_the_runtime_starts(tmp_path):
    out = _probe(tmp_path)
    assert out["xnnpack_off"] in (True, None), f"XLA compiled with XNNPACK on: {out['listed']}"
    assert out["stale"] == [] and out["fast"] is True
    assert out["reused"] == [True, True], out["summary"]  # donation itself is unchanged
    if ON_BY_DEFAULT:
        assert out["state"] == "added"
        assert out["flags"].split().count("--xla_cpu_use_xnnpack=false") == 1
        assert len(out["log"]) == 1 and "--xla_cpu_use_xnnpack=false" in out["log"][0]
    else:  # off already: XLA_FLAGS left alone, nothing said
        assert out["state"] == "off by default"
        assert "xnnpack" not in out["flags"] and out["log"] == []


@pytest.mark.parametrize("case", ["xnnpack on", "runtime started", "keep"])
def test_unprotected_process_warns_once_at_the_first_donation(tmp_path, case):
    kwargs = {
        "xnnpack on": {"xla_flags": "--xla_cpu_use_xnnpack=true"},
        "runtime started": {"start_runtime": True},
        "keep": {"TORCH_XLA_DONATE_CPU_XNNPACK": "keep"},
    }[case]
    out = _probe(tmp_path, **kwargs)
    assert "--xla_cpu_use_xnnpack=false" not in out["flags"]
    assert out["fast"] is True  # warned once: the fast path is open again
    assert out["reused"] == [True, True], out["summary"]
    if case != "xnnpack on" and not ON_BY_DEFAULT:
        # This XLA has XNNPACK off anyway: nothing to warn about.
        assert out["state"] == "off by default" and out["stale"] == []
        assert out["xnnpack_off"] in (True, None)
        return
    assert out["state"] == "warn"
    assert len(out["stale"]) == 1, out["stale"]  # two donations, one warning
    assert "XLA_FLAGS='--xla_cpu_use_xnnpack=false'" in out["stale"][0]
    assert out["xnnpack_off"] in (False, None)


# The SPMD recipe: XLA_FLAGS replaced after the imports (issue 31).
_REPLACE = ('os.environ["XLA_FLAGS"] = '
            '"--xla_force_host_platform_device_count=4 --xla_dump_to={dump}"')
# Before, through, and after the runtime's start: torch_xla.device() is the
# public way in (the package sees it coming); a tensor created with
# device="xla" starts the runtime from C++ (it sees only the result).
_REPLACED = {
    "then torch_xla.device()": _REPLACE,
    "then xm.xla_device()": _REPLACE + "\nimport torch_xla.core.xla_model as xm; xm.xla_device()",
    "then a tensor on the device": _REPLACE + '\ntorch.ones(2, device="xla").cpu()',
    "after the runtime started": 'torch.ones(2, device=torch_xla.device()).cpu()\n' + _REPLACE,
}


@pytest.mark.parametrize("order", list(_REPLACED))
def test_xla_flags_replaced_after_the_import(tmp_path, order):
    """What XLA compiled with is what the package reports, in every order:
    the flag is added again while the runtime has not read XLA_FLAGS, a
    start the package could not see is reported as lost and warned about
    once, and a replacement after the start changes nothing."""
    out = _probe(tmp_path, after_import=_REPLACED[order])
    assert out["reused"] == [True, True], out["summary"]  # donation itself is unchanged
    assert "--xla_force_host_platform_device_count=4" in out["flags"]
    guard = out["metrics"].split("Setting: XlaCpuXnnpackGuard\n  Value: ")[-1]
    if not ON_BY_DEFAULT:  # 2.7, 2.8: nothing was added, nothing is owed
        assert out["state"] == "off by default" and out["stale"] == []
        assert out["xnnpack_off"] in (True, None)
        return
    expected = {"then torch_xla.device()": "re-added", "then xm.xla_device()": "re-added",
                "then a tensor on the device": "lost",
                "after the runtime started": "added"}[order]
    assert out["state"] == expected, out
    assert guard.startswith(expected + " ("), out["metrics"]
    if expected == "lost":
        assert out["xnnpack_off"] is False, out["listed"]
        assert len(out["stale"]) == 1, out["stale"]  # two donations, one warning
        assert "XLA_FLAGS was assigned after torch_xla_donate was imported" in out["stale"][0]
        assert "XLA:CPU: XNNPACK ON" in out["summary"]
        assert "--xla_cpu_use_xnnpack=false" not in out["flags"]
    else:
        assert out["xnnpack_off"] is True, out["listed"]
        assert out["stale"] == [] and out["fast"] is True
        assert "XLA:CPU: XNNPACK off" in out["summary"]
        # Re-added to the user's XLA_FLAGS; a replacement after the start
        # keeps the user's text (XLA read the flags already).
        assert out["flags"].split().count("--xla_cpu_use_xnnpack=false") == (
            expected == "re-added")
        assert any("replaced" in line for line in out["log"]) == (expected == "re-added")


def test_a_choice_in_xla_flags_is_left_alone(tmp_path):
    out = _probe(tmp_path, xla_flags="--xla_cpu_use_xnnpack=0")
    assert out["state"] == "chosen"
    assert "--xla_cpu_use_xnnpack=false" not in out["flags"]
    assert out["stale"] == [] and out["log"] == []
    assert out["xnnpack_off"] in (True, None)


def test_flag_search_finds_it_in_this_torch_xla(tmp_path):
    """The search that decides whether XLA knows the flag finds it in the
    wheel's library, and only there: the import must never add a flag an
    XLA without it would abort on."""
    assert xla_cpu.flag_supported(torch_xla._XLAC.__file__)
    without = tmp_path / "without.so"
    without.write_bytes(b"\x00xla_cpu_use_thunk_runtime\x00xla_cpu_use_xnnpack_v2\x00")
    with_it = tmp_path / "with.so"
    with_it.write_bytes(b"\x00xla_cpu_use_thunk_runtime\x00xla_cpu_use_xnnpack\x00")
    assert not xla_cpu.flag_supported(str(without))
    assert xla_cpu.flag_supported(str(with_it))
    assert not xla_cpu.flag_supported(os.devnull)  # empty: nothing to map


def _repro(*args):
    import subprocess
    import sys

    repro = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "repros",
                         "xnnpack_stale_read.py")
    return subprocess.run([sys.executable, repro, *args], env=dict(os.environ, PJRT_DEVICE="CPU"),
                          capture_output=True, text=True, timeout=600)


def _cpu_has_avx512() -> bool:
    with open("/proc/cpuinfo") as f:
        return "avx512f" in f.read()


def test_the_stale_read_is_caught_and_the_import_prevents_it():
    """tools/repros/xnnpack_stale_read.py at width 1024, buffers reused in
    place and by donation, every step's loss compared bit for bit with a run
    that never reuses a buffer (the repro exits 1 on any difference).

    * With ``torch_xla_donate`` imported first (it adds the flag at import)
      every loss is right and the graphs were compiled with XNNPACK off.
    * With XLA's defaults the repro must see the stale read.  Measured: it
      does on this project's AVX2 EPYC VMs (2026-11-24), and an AVX-512 EPYC
      computed right (2026-11-23), so there the default run may be right.
      torch_xla 2.7 and 2.8 have XNNPACK off by default: right everywhere.
    """
    protected = _repro("--xnnpack", "package", "--width", "1024")
    assert protected.returncode == 0, protected.stdout + protected.stderr[-2000:]
    assert ("xla_cpu_use_xnnpack: false" in protected.stdout if ON_BY_DEFAULT
            else "options the graphs had: defaults" in protected.stdout), protected.stdout
    assert protected.stdout.count("buffer reused [True, True, True]") == 2
    assert protected.stdout.count(": OK") == 2

    default = _repro("--xnnpack", "default", "--width", "1024")
    assert default.returncode in (0, 1), default.stdout + default.stderr[-2000:]
    if not ON_BY_DEFAULT:  # 2.7, 2.8: XNNPACK off by default, right values
        assert default.returncode == 0, default.stdout
    elif default.returncode == 0:
        assert _cpu_has_avx512(), (
            "the repro no longer sees the stale read with XLA's defaults on a CPU without "
            "AVX-512, where it did:\n" + default.stdout)
    else:
        assert default.stdout.count(": STALE") == 2, default.stdout


_FAILING_COMPILES = """
import os
import torch, torch_xla
import torch_xla.core.xla_model as xm
from torch_xla.experimental.stablehlo_custom_call import stablehlo_custom_call
import torch_xla_donate as tdx
print("flags:", os.environ.get("XLA_FLAGS", ""))
tdx.configure(auto=True)
dev = torch_xla.device()


def step(box, explicit):
    xs = box.pop()
    if explicit:
        tdx.donate(xs)
    new = [x * 3 for x in xs]
    bad = stablehlo_custom_call([xs[0]], "torch_xla_donate_no_such_target", [list(xs[0].shape)],
                                [xs[0].dtype], api_version=1)
    del xs  # dead inputs: auto arms them
    torch_xla.sync()


failed = 0
for r in range(100):
    box = [[torch.arange(8.0, device=dev) + k for k in range(5)]]
    torch_xla.sync()
    reported = False
    for call in (lambda: step(box, explicit=r % 4 == 3), xm.wait_device_ops, xm.wait_device_ops):
        try:  # 2.8+ raise at the sync; 2.7 at the next wait, and again at the one after
            call()
        except (RuntimeError, ValueError):
            reported = True
    failed += reported
print("failed:", failed)
"""


def _malloc_debug() -> str:
    found = glob.glob("/lib/*/libc_malloc_debug.so.0") + glob.glob("/usr/lib/*/libc_malloc_debug.so.0")
    assert found, "glibc's libc_malloc_debug.so.0 (MALLOC_CHECK_) is missing on this machine"
    return found[0]


def test_failed_compiles_with_donors_leave_the_heap_whole():
    """A caught compile failure in steps with armed inputs (auto's dead inputs, explicit donors
    every fourth round), 100 rounds under glibc's malloc checks.  XLA:CPU's parallel fusion
    emitter corrupts the heap there: with ``--xla_cpu_use_fusion_emitters=true`` 5 of 5 runs
    died (SIGSEGV, or SIGABRT "free(): invalid pointer" in ``ParallelFusionEmitter::
    CompileFusion``; 2026-11-29).  With auto on from the import, the import switches the
    emitters off where XLA knows the flag; without it, it leaves them on (bit-equal rounding)."""
    proc = run_python(_FAILING_COMPILES, env={"LD_PRELOAD": _malloc_debug(), "MALLOC_CHECK_": "3",
                                              "TORCH_XLA_DONATE_AUTO": "1"})
    assert "failed: 100" in proc.stdout, proc.stdout
    knows = xla_cpu.flag_supported(torch_xla._XLAC.__file__, xla_cpu.COMPILE_FLAG)
    assert (f"{xla_cpu.COMPILE_FLAG}=false" in proc.stdout) == knows, proc.stdout
    plain = run_python("import os, torch_xla_donate\nprint(os.environ.get('XLA_FLAGS', ''))",
                       env={"TORCH_XLA_DONATE_AUTO": "0"})
    assert xla_cpu.COMPILE_FLAG not in plain.stdout, plain.stdout
