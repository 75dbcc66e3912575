"""XLA:CPU copies a KV cache that a step updates and then reads, unless the
update and the read take a form it can do in place.

No torch_xla_donate here: the cache is donated with torch_xla's own
``_set_buffer_donation``, so that the step's output may take the old cache's
buffers.  Each case runs one layer's attention step in a process of its own
and prints the temporaries XLA allocates for the step's graph (from the
``*memory-usage-report.txt`` of ``--xla_dump_to``) and how much the peak
resident memory grew over three donated steps.  The cache is 2 x 16 MiB.

    PJRT_DEVICE=CPU python tools/repros/kv_cache_update_copies.py

Cases (decode: one token at a position held on the device; prompt: 32
tokens at positions 0..31):

* ``decode, 4-D cache``: k/v f32[4, 8, 2048, 64], ``index_copy(2, pos, k)``,
  then ``q @ k_cache.transpose(-1, -2)``.  torch_xla's batched matmul
  reshapes the updated cache to 3-D; XLA then fuses the update into each
  reader separately, each on a copy of the cache.
* ``decode, 3-D cache``: k/v f32[32, 2048, 64] (batch and heads merged),
  ``index_copy(1, pos, k)``: updated in place, no temporary of cache size.
* ``prompt, index_copy``: 3-D cache, ``index_copy(1, arange(32), k)``: a
  scatter with several indices, which XLA runs on a transposed copy.
* ``prompt, slice_scatter``: 3-D cache, ``slice_scatter(k, 1, 0, 32)``:
  in place.

Measured on 2026-11-24 (torch_xla 2.9.0, XLA:CPU), three runs:

    decode, 4-D cache        XLA temporaries   32.2 MiB, peak grew 15.9 / 32.5 / 47.9 MiB
    decode, 3-D cache        XLA temporaries    0.5 MiB, peak grew  0.6 /  0.5 /  0.6 MiB
    prompt, index_copy       XLA temporaries   48.2 MiB, peak grew 58.2 / 64.5 / 58.9 MiB
    prompt, slice_scatter    XLA temporaries   16.0 MiB, peak grew 16.4 / 16.2 / 16.3 MiB

(a prompt's scores and their exponentials, f32[32, 32, 2048], are 16 MiB:
``slice_scatter`` adds nothing to them, ``index_copy`` a second cache).  The
donation itself works in every case: after four steps the cache is still in
its first buffers (``_unsafe_buffer_pointer``).  With
``F.scaled_dot_product_attention`` instead of scaling the queries, the
scaled copy of the keys adds a temporary of the keys' size.
``examples/decode_kv_cache.py`` uses the two in-place forms.
"""
import glob
import os
import subprocess
import sys
import tempfile

CASES = ["decode, 4-D cache", "decode, 3-D cache", "prompt, index_copy", "prompt, slice_scatter"]
B, H, P, D, T = 4, 8, 2048, 64, 32


def status_mib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1]) / 1024


def child(case, dump):
    import ctypes

    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    dev = torch_xla.device()
    four_d = case == "decode, 4-D cache"
    shape = (B, H, P, D) if four_d else (B * H, P, D)
    k_cache, v_cache = torch.zeros(shape, device=dev), torch.zeros(shape, device=dev)
    t = 1 if case.startswith("decode") else T
    x = torch.randn(*shape[:-2], t, D, device=dev)
    pos = torch.tensor([5], device=dev)
    torch_xla.sync()

    def step(x, k_cache, v_cache):
        q, k, v = x * 0.5, x * 2, x * 3
        if case == "prompt, slice_scatter":
            k_cache, v_cache = k_cache.slice_scatter(k, 1, 0, t), v_cache.slice_scatter(v, 1, 0, t)
            positions = torch.arange(t, device=dev)
        else:
            positions = pos if t == 1 else torch.arange(t, device=dev)
            dim = len(shape) - 2
            k_cache, v_cache = k_cache.index_copy(dim, positions, k), v_cache.index_copy(dim, positions, v)
        seen = torch.arange(P, device=dev)[None, :] <= positions[:, None]
        scores = (q * D ** -0.5) @ k_cache.transpose(-1, -2)
        return scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v_cache, k_cache, v_cache

    ctypes.CDLL("libc.so.6").mallopt(-3, 65536)  # freed buffers leave the resident set
    pointer = torch_xla._XLAC._unsafe_buffer_pointer
    xm.wait_device_ops()  # on CPU only this waits for the buffers to exist
    first = pointer(k_cache), pointer(v_cache)
    for i in range(4):
        if i == 1:  # compiled: measure from here
            xm.wait_device_ops()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = status_mib("VmRSS:")
        for c in (k_cache, v_cache):
            torch_xla._XLAC._set_buffer_donation(c, True)
        x, k_cache, v_cache = step(x, k_cache, v_cache)
        torch_xla.sync()
        xm.wait_device_ops()
    growth = status_mib("VmHWM:") - base
    kept = (pointer(k_cache), pointer(v_cache)) == first
    temp = 0.0
    for path in glob.glob(os.path.join(dump, "*memory-usage-report.txt")):
        with open(path) as f:
            for line in f:
                if "preallocated-temp" in line:
                    size = line.split("size ")[1].split(",")[0]
                    mib = float(size[:-3]) * {"MiB": 1, "KiB": 1 / 1024}.get(size[-3:], 1 / 2**20)
                    temp = max(temp, mib)
    print(f"{case:24s} XLA temporaries {temp:6.1f} MiB, peak grew {growth:6.1f} MiB "
          f"(cache {2 * k_cache.nbytes / 2**20:.0f} MiB, in its first buffers: {kept})")


def main():
    if len(sys.argv) == 3:
        return child(sys.argv[1], sys.argv[2])
    for case in CASES:
        with tempfile.TemporaryDirectory() as dump:
            env = dict(os.environ, PJRT_DEVICE="CPU", TF_CPP_MIN_LOG_LEVEL="2",
                       XLA_FLAGS=f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
                                 "--xla_cpu_use_xnnpack=false")
            proc = subprocess.run([sys.executable, __file__, case, dump], env=env, check=False,
                                  capture_output=True, text=True)
            print(proc.stdout.strip() or proc.stderr[-2000:])


if __name__ == "__main__":
    main()
