"""torch_xla 2.9 crashes (SIGSEGV) when asked about a sharded buffer that is
still being computed.

No torch_xla_donate here.  Under SPMD, a step run with
``torch_xla.sync(wait=False)`` leaves its sharded outputs in flight for a
moment; ``torch_xla._XLAC._get_tensors_handle([t])`` or
``_get_tensors_xla_device_data_node([t], [t])`` on such an output kills the
process.  On a materialized sharded tensor both answer.

    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python tools/repros/sharded_inflight_query.py handle
    CPU_NUM_DEVICES=4 PJRT_DEVICE=CPU python tools/repros/sharded_inflight_query.py owner

Measured on 2026-11-24 (torch_xla 2.9.0, XLA:CPU, 4 virtual devices): both
forms crash 3 of 3 runs (exit status 139) within five steps; after
``xm.wait_device_ops()`` both answer.  This is why torch_xla_donate asks
neither question about sharded tensors (sharing.py) nor about tensors older
than the last barrier when marking (ownership.owns_its_buffer).
"""
import sys

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.distributed.spmd as xs
import torch_xla.runtime as xr

xr.use_spmd()
XLAC = torch_xla._XLAC
QUESTIONS = {
    "handle": lambda t: XLAC._get_tensors_handle([t]),
    "owner": lambda t: XLAC._get_tensors_xla_device_data_node([t], [t])[0],
}


def main(question: str) -> None:
    ask = QUESTIONS[question]
    devices = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(devices), (devices, 1))
    t = torch.randn(64, 48).to(torch_xla.device())
    xs.mark_sharding(t, mesh, (0, None))
    torch_xla.sync()
    xm.wait_device_ops()
    print("materialized:", ask(t), flush=True)
    for i in range(5):
        r = t + i
        torch_xla.sync(wait=False)
        print(f"in flight, step {i}:", ask(r), flush=True)  # the crash comes here
    print("no crash in 5 steps")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "handle")
