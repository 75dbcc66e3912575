"""torch_xla 2.9 (XLA:CPU) corrupts its heap when a step with donated buffers
fails to compile.

No torch_xla_donate here.  Each round traces a step that uses five
materialized tensors plus a custom call XLA cannot compile (no registered
target) and swallows the compile error; by default the five tensors are
donated with torch_xla's own ``_set_buffer_donation``.  Run with glibc's
malloc checks to see the corruption at once:

    LD_PRELOAD=/lib/x86_64-linux-gnu/libc_malloc_debug.so.0 MALLOC_CHECK_=3 \\
        PJRT_DEVICE=CPU python tools/repros/compile_error_with_donation.py [--no-donate]

Measured on 2026-11-22 (torch_xla 2.9.0, XLA:CPU, 60 rounds): with donation
4 runs of 4 abort ("free(): invalid pointer"); with ``--no-donate`` 0 of 4.
On 2026-11-29, gdb put the abort in XLA:CPU's ``ParallelFusionEmitter::CompileFusion``
(a worker thread): with ``XLA_FLAGS=--xla_cpu_use_fusion_emitters=false`` 0 runs of 3
aborted, with donation on.  torch_xla_donate adds that flag at import on the CPU backend.
In our test suite the same corruption also showed as a segfault inside XLA's
CPU compiler (ParallelFusionEmitter teardown).  Without the malloc checks it
crashes a later, unrelated step now and then (about one run in four of
test_failed_steps.py), which is why test/conftest.py runs the tests that
provoke compile errors in their own process.
"""
import sys

import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla.experimental.stablehlo_custom_call import stablehlo_custom_call

ROUNDS = 60


def main(donate: bool) -> None:
    dev = torch_xla.device()
    donor_flag = torch_xla._XLAC._set_buffer_donation
    for _ in range(ROUNDS):
        xs = [torch.arange(8.0, device=dev) + k for k in range(5)]
        torch_xla.sync()
        if donate:
            for x in xs:
                donor_flag(x, True)
        outs = [x * 3 for x in xs]
        bad = stablehlo_custom_call([xs[0]], "no_such_target", [list(xs[0].shape)],
                                    [xs[0].dtype], api_version=1)
        try:
            torch_xla.sync()
        except (RuntimeError, ValueError):
            pass  # the compile error we asked for
        if donate:
            for x in xs:
                donor_flag(x, False)  # as after any step: no mark may fire later
        del bad, outs
        xm.wait_device_ops()
    print(f"{ROUNDS} failed compiles, donation {'on' if donate else 'off'}: no crash")


if __name__ == "__main__":
    main(donate="--no-donate" not in sys.argv[1:])
