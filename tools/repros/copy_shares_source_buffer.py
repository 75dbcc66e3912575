"""torch_xla 2.9 backs a copy with its source's device buffer, and loses the
source when the copy is updated in place.

No torch_xla_donate here, and no explicit donation.  ``c.copy_(t)``,
``target.load_state_dict(policy.state_dict())``, ``t.to(device, copy=True)``,
``x[...] = t`` and ``torch.tensor(t)`` give the copy an IR that is the
source's DeviceData; the next barrier makes the source's buffer the copy's
own too (one handle for both, ``_get_tensors_handle``) and files it under
the copy.  An in-place update of the copy then lets torch_xla's automatic
aliasing of in-place updates donate that buffer to the copy's new value:
the source's buffer is gone, though nothing touched the source.

    PJRT_DEVICE=CPU python tools/repros/copy_shares_source_buffer.py
    XLA_ENABLE_PARAM_ALIASING=0 PJRT_DEVICE=CPU python tools/repros/copy_shares_source_buffer.py

Measured on 2026-11-23 (torch_xla 2.9.0, XLA:CPU): the source is lost in
both cases below ("Trying to access XLA data ... while an async operation is
in flight" on every later read); with XLA_ENABLE_PARAM_ALIASING=0 both keep
their values.  ``clone()`` is not affected: a barrier computes a clone into a
buffer of its own.

The same sharing is why torch_xla_donate refuses to donate a copy made since
the last barrier (it still holds its source's buffer), and what it cannot
see from outside torch_xla: sharing older than the last barrier (README,
"Limits").
"""
import torch
import torch_xla
import torch_xla.core.xla_model as xm


def read(t):
    try:
        return t.cpu().tolist()
    except RuntimeError as error:
        return f"LOST ({str(error).splitlines()[0][:80]}...)"


def main():
    dev = torch_xla.device()

    # 1. A plain tensor and its copy.
    t = torch.arange(4.0, device=dev)
    torch_xla.sync()
    c = torch.empty_like(t)
    c.copy_(t)
    torch_xla.sync()
    shared = len(set(torch_xla._XLAC._get_tensors_handle([t, c]))) == 1
    c.mul_(10)  # only the copy is updated
    torch_xla.sync()
    xm.wait_device_ops()
    print(f"copy_:           one buffer for both: {shared}; copy {read(c)}; source {read(t)}")

    # 2. A target network loaded from a policy network (DQN style).
    policy = torch.nn.Linear(2, 2).to(dev)
    target = torch.nn.Linear(2, 2).to(dev)
    torch_xla.sync()
    expected = policy.weight.detach().cpu().tolist()
    target.load_state_dict(policy.state_dict())
    torch_xla.sync()
    with torch.no_grad():
        target.weight.add_(1.0)  # e.g. a soft update of the target only
    torch_xla.sync()
    xm.wait_device_ops()
    print(f"load_state_dict: policy.weight was {expected}; now {read(policy.weight.detach())}")


if __name__ == "__main__":
    main()
