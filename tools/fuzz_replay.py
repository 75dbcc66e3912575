"""Replays programs recorded by test/scenarios/test_fuzz.py (``TDX_FUZZ_TRACE=file``)
in one fresh process, in order, and stops at the first failure.

    PJRT_DEVICE=CPU .venv/bin/python tools/fuzz_replay.py TRACE [--no-donate] [--keep 3,4]

``--no-donate`` runs the same draws with ``donate_buffer`` replaced by
nothing and the plugin's step hook uninstalled: both twins of each program
are then plain torch_xla.  A failure that remains is torch_xla's own.
``--keep`` replays only the listed examples (0-based lines of TRACE), to cut
the history a failure needs down to a few programs.

Traces in tools/fuzz_traces/ (torch_xla 2.9.0, CPU), each two programs
whose second one fails in a fresh process with ``--no-donate``, that is with
no donation and no plugin hook at all: torch_xla bugs that depend on what an
earlier program left behind (its compile cache), found by the long fuzz:

* torch_xla_parameter_size.trace: the second program's barrier raises
  "Executable expected parameter 4 of size 32 but got buffer with
  incompatible size 64" (with and without ``--no-donate``);
* torch_xla_wrong_value.trace: with ``--no-donate``, the second program
  reads a wrong s32 value in the never-donated twin ("reference 24,
  donating 8, CPU torch 8").  With donation the draws make a different
  program, which passes.
"""
import argparse
import importlib.util
import os
import sys
import warnings

import torch
import torch_xla

import torch_xla_donate as tdx
from torch_xla_donate import _hooks
from torch_xla_donate._native import C

# The fuzzer's program, loaded from its file (the test suite is no package
# this tool should put on the import path).
_PROGRAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "test", "scenarios",
                        "fuzz_program.py")
_spec = importlib.util.spec_from_file_location("fuzz_program", _PROGRAM)
fuzz_program = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fuzz_program)


class Draws:
    """Stands in for hypothesis' ``data``: hands out the recorded values."""

    def __init__(self, values):
        self.values = list(values)

    def draw(self, strategy, label=None):
        return self.values.pop(0)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--no-donate", action="store_true")
    parser.add_argument("--keep", default="")
    args = parser.parse_args()
    if args.no_donate:
        _hooks.uninstall()
        fuzz_program.Program.donate = lambda self, entry, defer: None
        fuzz_program.Program.judge = lambda self, expectations: None
    with open(args.trace) as f:
        lines = f.read().splitlines()
    indices = [int(i) for i in args.keep.split(",") if i] or range(len(lines))
    for i in indices:
        program = fuzz_program.Program(Draws(eval(lines[i], {"torch": torch})), torch_xla.device())
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                program.run()
        except IndexError:
            print(f"example {i}: the trace ends early (hypothesis abandoned it); skipped")
        except Exception as e:  # noqa: BLE001 - report whatever it is
            print(f"example {i} FAILS: {type(e).__name__}: {e}")
            print("program:\n  " + "\n  ".join(program.log))
            return 1
        finally:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tdx.settle()
                for t in C.marked_tensors():
                    tdx.undonate(t)
            del program
            torch_xla.sync()
    print(f"{len(indices)} examples replayed, no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
