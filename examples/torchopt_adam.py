"""torchopt's functional Adam with the parameters and its state donated.

    pip install torchopt
    PJRT_DEVICE=CPU python examples/torchopt_adam.py [--steps 20]

torchopt's functional API returns new tensors: ``optimizer.update(...,
inplace=False)`` a new state, ``torchopt.apply_updates(..., inplace=False)``
new parameters.  Without donation each step holds the old and the new
parameters and moments at its peak.  ``tdx.donate((params, opt_state))``
before the update lets the step write the new ones into the old buffers
(torchopt's 0-dim step counters are left out: they are never donated).
Prints the loss and the plugin's report.
"""
import argparse
import os
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args(argv)
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    try:
        import torchopt
    except ImportError:
        sys.exit("this example needs torchopt: pip install torchopt")
    import torch
    import torch_xla

    import torch_xla_donate as tdx

    dev = torch_xla.device()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, args.width, generator=gen).to(dev)
    y = torch.randn(64, args.width, generator=gen).to(dev)
    params = {"w": (torch.randn(args.width, args.width, generator=gen) * 0.02).to(dev),
              "b": torch.zeros(args.width, device=dev)}
    optimizer = torchopt.adam(1e-3)
    opt_state = optimizer.init(params)
    torch_xla.sync()  # only materialized tensors can be donated

    def loss_fn(params):
        return ((x @ params["w"] + params["b"] - y) ** 2).mean()

    for step in range(args.steps):
        grads, loss = torch.func.grad_and_value(loss_fn)(params)
        tdx.donate((params, opt_state))  # the old parameters and moments are dead after this step
        updates, opt_state = optimizer.update(grads, opt_state, params=params, inplace=False)
        params = torchopt.apply_updates(params, updates, inplace=False)
        torch_xla.sync()  # the new ones are written into the old buffers
        if step % 5 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}")
    tdx.settle()
    print(tdx.summary())


if __name__ == "__main__":
    main()
