"""SPMD: a sharded state updated functionally, its shards donated each step.

    PJRT_DEVICE=CPU python examples/spmd_sharded_state.py [--devices 4] [--steps 5]

On the CPU backend ``CPU_NUM_DEVICES`` gives torch_xla several devices (set
here before its runtime starts).  The state is sharded over a 1-D mesh with
``xs.mark_sharding``; each step computes a new state from the old one, and
``tdx.donate(state)`` lets every shard of the new state be written into the
old shard's buffer.  The old tensors are poisoned: using one raises
``DonatedBufferError``.  The script prints the plugin's report.
"""
import argparse
import os


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", str(args.devices))

    import numpy as np
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    import torch_xla_donate as tdx

    xr.use_spmd()
    dev = torch_xla.device()
    n = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(n), (n, 1), ("data", "model"))
    state = [torch.randn(1024, 256).to(dev) for _ in range(4)]
    for t in state:
        xs.mark_sharding(t, mesh, ("data", None))
    torch_xla.sync()  # only materialized tensors can be donated

    for _ in range(args.steps):
        old = state
        tdx.donate(state)  # every shard of the old state is dead after this step
        state = [0.9 * s + 0.1 for s in state]
        torch_xla.sync()  # each new shard lands in the old shard's buffer
    tdx.settle()
    print(f"devices: {n}; sharding: {torch_xla._XLAC._get_xla_sharding_spec(state[0])}")
    try:
        old[0].sum()
    except tdx.DonatedBufferError as e:
        print(f"the old state is poisoned: {type(e).__name__}")
    print(tdx.summary())


if __name__ == "__main__":
    main()
