"""The KV-cache decoding example: the same tokens with and without donation,
lazy and compiled; the donated cache costs no second copy at peak; no
compile once warm (one prefill graph per prompt bucket, one decode graph).

The four runs (lazy / torch.compile, with / without donation) start together
in their own processes: each measures its own peak memory, and they share the
machine's two cores instead of queuing for them.
"""
import importlib.util
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
from helpers import child_env

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "decode_kv_cache.py"

# CI sizes: a 64 MiB cache (1 layer x (k, v) x f32[32, 4096, 64]), so that
# one cache stands out of the peak memory's noise, on a model that compiles
# in seconds.  Prompts of 5-24 tokens fall into two buckets (16 and 32).
LAYERS, REQUESTS, NEW_TOKENS = 1, 2, 8
BUCKETS = (16, 32)
ARGS = ("--layers", str(LAYERS), "--batch-size", "8", "--heads", "4", "--head-dim", "64",
        "--positions", "4096", "--vocab", "128", "--requests", str(REQUESTS),
        "--new-tokens", str(NEW_TOKENS), "--prompt-min", "5", "--prompt-max", "24",
        "--bucket", "16")
MODES = {
    "lazy": (),
    "lazy, no donation": ("--no-donate",),
    "compiled": ("--compile",),
    "compiled, no donation": ("--compile", "--no-donate"),
}


def _run(modes) -> dict:
    """Runs the example in each of ``modes`` at once, one process each:
    {mode: (stdout, stderr)}."""
    env = child_env()
    procs = {mode: subprocess.Popen([sys.executable, str(EXAMPLE), *ARGS, *MODES[mode]], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for mode in modes}
    out = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{mode} failed:\n{stdout}\n{stderr}"
        out[mode] = (stdout, stderr)
    return out


@pytest.fixture(scope="module")
def runs():
    return _run(MODES)


def _number(pattern, text) -> float:
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in:\n{text}"
    return float(match.group(1))


def _tokens(out):
    """Every request's first row, and the digest of all generated tokens."""
    rows = re.findall(r"request \d+: .*row 0: ([\d ]+)", out)
    assert len(rows) == REQUESTS and all(len(r.split()) == NEW_TOKENS for r in rows), out
    return rows, re.search(r"tokens sha256: ([0-9a-f]+)", out).group(1)


@pytest.mark.parametrize("kind", ["lazy", "compiled"])
def test_donation_leaves_the_tokens_as_they_were(runs, kind):
    assert _tokens(runs[kind][0]) == _tokens(runs[f"{kind}, no donation"][0])


@pytest.mark.parametrize("kind", ["lazy", "compiled"])
def test_every_step_donates_the_whole_cache_and_every_buffer_is_reused(runs, kind):
    out, err = runs[kind]
    # Warm-up: a prefill and two decode steps per bucket; then the requests.
    steps = len(BUCKETS) * 3 + REQUESTS * NEW_TOKENS
    buffers = steps * LAYERS * 2
    assert _number(r"donated (\d+) buffer", out) == buffers
    assert _number(r"reused \(poisoned\) +(\d+)", out) == buffers
    for verdict in ("unused", "updated in place", "dropped", "failed", "lost"):
        assert _number(rf"\n  {verdict} +(\d+)", out) == 0, verdict
    assert not re.search(r"(Donation|StaleRead)\w*(Warning|Error)", err), err
    plain = runs[f"{kind}, no donation"][0]
    assert _number(r"donated (\d+) buffer", plain) == 0


@pytest.mark.parametrize("kind", ["lazy", "compiled"])
def test_the_donated_cache_costs_no_second_copy_at_peak(runs, kind):
    # Without donation a step holds the old and the new cache; with it, the
    # new cache is written over the old one (what remains is the prefill's
    # attention scores and noise).  The plain run's growth is about one cache
    # or more (torch_xla 2.7 compiled: 60 MiB for a 64 MiB cache), which shows
    # the measurement sees a copy.  (torch_xla 2.8 lazy gave 54.5 donated
    # against 58.0 plain once: the small cache is near the allocator's noise.)
    # A plain run that shows no copy measured nothing.  It read 18.9 and
    # 34.6 MiB twice in CI, with the four runs sharing two CPUs: XLA freed
    # the warm-up's old cache on its own threads after the base was read,
    # up to 64 MiB of it 50 ms later, so the base counted memory serving
    # never needed.  The example now reads its base once the resident size
    # stops falling (decode_kv_cache.py _settled_rss); should a control
    # still show no copy, the pair runs again, up to twice, and the donated
    # run is judged beside a plain one that saw the copy.
    grew = r"peak memory growth while serving: ([0-9.]+) MiB"
    pair, seen = {kind: runs[kind], f"{kind}, no donation": runs[f"{kind}, no donation"]}, []
    for attempt in range(3):
        if attempt:
            # Said in the run's warnings summary: the evidence for dropping
            # the retry once CI runs show it is never needed.
            warnings.warn(f"decode {kind}: the plain run saw no copy {seen[-1]}; running the "
                          "pair again", pytest.PytestWarning, stacklevel=1)
            pair = _run([kind, f"{kind}, no donation"])
        cache = _number(r"the cache is ([0-9.]+) MiB", pair[kind][0])
        donated = _number(grew, pair[kind][0])
        plain = _number(grew, pair[f"{kind}, no donation"][0])
        seen.append((donated, plain))
        if plain > 0.75 * cache:
            break
    assert plain > 0.75 * cache, f"no plain run saw a copy of the {cache} MiB cache: {seen}"
    assert donated < cache, (donated, cache, seen)


@pytest.mark.parametrize("mode", list(MODES))
def test_no_compile_once_warm(runs, mode):
    out = runs[mode][0]
    line = re.search(r"compiles: .*", out).group(0)
    # One prefill graph per prompt bucket, one decode graph, compiled by the
    # first step of each; nothing later, in the warm-up or while serving.
    # The package's native-reads self-test compiles one small graph of its
    # own at the process's first donation (README, Native reads): the first
    # prefill's count may include it.
    prefill, buckets = map(int, re.search(r"prefill (\d+) \((\d+) bucket", line).groups())
    assert buckets == len(BUCKETS) and prefill - len(BUCKETS) in (0, 1), line
    assert "first decode step 1, later decode steps 0; serving 0" in line, line
    if mode.startswith("compiled"):
        # Dynamo traced each graph once: no re-trace that found its XLA
        # graph cached either.
        assert f"dynamo graphs traced: warm-up {len(BUCKETS) + 1}, serving 0" in out, out


def test_decode_example_checks_its_arguments():
    spec = importlib.util.spec_from_file_location("decode_kv_cache", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = example.parse_args(["--compile", "--no-donate"])
    assert args.compile and not args.donate
    assert example.bucket_of(17, 16) == 32 and example.bucket_of(16, 16) == 16
    for bad in (["--layers", "0"], ["--prompt-min", "9", "--prompt-max", "8"],
                ["--positions", "64", "--new-tokens", "40"]):
        with pytest.raises(SystemExit):
            example.parse_args(bad)
