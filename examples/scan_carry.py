"""A ``torch_xla.experimental.scan`` loop whose carry is donated.

    PJRT_DEVICE=CPU python examples/scan_carry.py [--mib 128] [--steps 4] [--no-donate]

The carry is a large state (an exponential moving average of a stream of
rows, ``--mib`` MiB of float32).  Each step runs ``scan`` over a few rows and
feeds the final carry back in.  Donating the carry before each step lets the
final carry be written into the initial carry's buffer: the device pointer
stays the same step after step, and the old carry tensor is poisoned.

The script prints the growth of the process's peak memory (``VmHWM``) over
the loop.  Run it once more with ``--no-donate`` to compare (peak memory only
grows, so each mode needs its own process; the peak is reset before the
loop): on CPU a 128 MiB carry costs about two carries (~256 MiB) more at peak
without donation, on torch_xla 2.7, 2.8 and 2.9.
"""
import argparse
import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402
import torch_xla  # noqa: E402
import torch_xla.core.xla_model as xm  # noqa: E402
from torch_xla.experimental.scan import scan  # noqa: E402

import torch_xla_donate as tdx  # noqa: E402

MIB = 1 << 20
COLUMNS = 4096


def peak_rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> None:
    """Starts the peak over from the current resident memory (Linux 4.0+).

    Without this the loop's peak is compared with the set-up's, whose
    transient memory (larger on torch_xla 2.7 and 2.8) hides part of it.
    """
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the growth is over the set-up's peak: a lower bound


def pointer(t: torch.Tensor) -> int:
    xm.wait_device_ops()  # on CPU only this waits for the step to run
    return torch_xla._XLAC._unsafe_buffer_pointer(t)


def ema(carry, row):
    new = carry * 0.9 + row * 0.1  # row broadcasts over the carry's rows
    return new, new[0, 0]


def run(carry, rows, steps: int, donate: bool):
    """Returns the final carry and the pointer after each step."""
    pointers = []
    for _ in range(steps):
        if donate:
            tdx.donate_buffer(carry)
        old = carry
        carry, _ = scan(ema, carry, rows)
        torch_xla.sync()
        pointers.append(pointer(carry))
        if donate:
            assert tdx.is_deleted(old)
        del old
    return carry, pointers


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=128, help="size of the carry")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--no-donate", action="store_true", help="the same loop without donation")
    args = parser.parse_args()
    donate = not args.no_donate

    dev = torch_xla.device()
    carry = torch.zeros(args.mib * MIB // (4 * COLUMNS), COLUMNS, device=dev)
    rows = torch.arange(3 * COLUMNS, dtype=torch.float32, device=dev).reshape(3, COLUMNS)
    torch_xla.sync()
    first = pointer(carry)
    print(f"carry: f32[{carry.shape[0]},{COLUMNS}] ({carry.nbytes / MIB:.0f} MiB) at {first:#x}")

    reset_peak_rss()
    base = peak_rss_mib()
    carry, pointers = run(carry, rows, args.steps, donate)
    growth = peak_rss_mib() - base
    for step, ptr in enumerate(pointers):
        print(f"step {step}: carry at {ptr:#x} same buffer: {ptr == first}")
    tdx.settle()
    stats = tdx.summary().totals
    print(f"reused by donation: {stats.reused} buffers, {stats.reused_bytes / MIB:.0f} MiB "
          f"the steps did not allocate again")
    print(f"peak memory growth over the loop ({'donated' if donate else 'not donated'}): {growth:.0f} MiB")
    print(f"carry[0, :3]: {carry[0, :3].cpu().tolist()}")


if __name__ == "__main__":
    main()
