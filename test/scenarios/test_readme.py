"""Every ```python block of the READMEs runs, and says what it prints.

Each block runs in a fresh process (readme_runner.py: step numbers in its
messages count from the import), compiled as ``train.py``, and its comments
are claims the runner checks: ``# True`` after an expression, ``#
DonatedBufferError, ...`` with the message in the comment lines under it,
``# <text>`` after a ``print``, a ```text block right after the block.

A block that is a fragment on purpose (an API inside a loop the reader
writes) carries a marker on a line of its own before it:

    <!-- readme-test: setup=NAME -->    NAME in SETUPS below: code run first,
                                        a one-line ``fill`` for its ``...``
                                        lines, and a ``check`` run after
    <!-- readme-test: skip REASON -->   only for a block that cannot run on
                                        one CPU process; REASON must be one
                                        of SKIP_REASONS

(No block is skipped today.)  The shell blocks are not run; the first one is
the README's two commands, which CI runs (.ci/run).
"""
import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
READMES = ["README.md", "benchmarks/README.md"]
RUNNER = pathlib.Path(__file__).with_name("readme_runner.py")

# Reasons a block may be skipped (a TPU-only or multi-host block); empty:
# every block runs.
SKIP_REASONS = set()


@dataclass(frozen=True)
class Setup:
    prelude: str
    fill: str | None = None
    check: str | None = None


SETUPS = {
    # "API": the import also installs torch_xla._XLAC.donate_buffer.
    "api": Setup(
        prelude="",
        check="import torch_xla\nassert torch_xla._XLAC.donate_buffer is tdx.donate_buffer\n",
    ),
    # "Training and inference loops": a functional SGD with momentum over
    # an MpDeviceLoader; every step donates the parameters and the state.
    "train_loop": Setup(
        prelude="""
import torch, torch_xla
import torch_xla.distributed.parallel_loader as pl
import torch_xla_donate as tdx

dev = torch_xla.device()
gen = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=gen), torch.randn(64, 2, generator=gen))
loader = torch.utils.data.DataLoader(data, batch_size=16)
params = {"w": torch.randn(8, 2, generator=gen).to(dev) * 0.1, "b": torch.zeros(2, device=dev)}
opt_state = {k: torch.zeros_like(p) for k, p in params.items()}
torch_xla.sync()

def sgd(params, opt_state, batch):
    x, y = batch
    loss = lambda ps: ((x @ ps["w"] + ps["b"] - y) ** 2).mean()
    grads = torch.func.grad(loss)(params)
    state = {k: 0.9 * opt_state[k] + grads[k] for k in params}
    return {k: params[k] - 0.05 * state[k] for k in params}, state
""",
        fill="new_params, new_opt_state = sgd(params, opt_state, batch)",
        check="""
tdx.settle()
totals = tdx.summary().totals
# 4 batches, 2 parameters and 2 momenta each; the loader's last iteration is
# a barrier too, so every step's marks were committed and reused.
assert totals.donated == totals.reused == 16, totals
""",
    ),
    # "Decoding with a KV cache": one attention layer per cache entry, the
    # cache 3-D, each token written with index_copy.
    "kv_cache": Setup(
        prelude="""
import torch, torch_xla
import torch_xla.debug.metrics as met
import torch_xla_donate as tdx

dev = torch_xla.device()
batch_heads, positions, head_dim, vocab, new_tokens = 4, 16, 8, 11, 6
emb = torch.randn(vocab, head_dim, generator=torch.Generator().manual_seed(0)).to(dev)

def model(ids, pos, cache):
    q, new_cache = emb[ids].unsqueeze(1), []
    for k, v in cache:
        k, v = k.index_copy(1, pos, q), v.index_copy(1, pos, 2 * q)
        q = torch.softmax(q @ k.transpose(1, 2), -1) @ v
        new_cache.append((k, v))
    return q.squeeze(1) @ emb.T, new_cache

ids = torch.zeros(batch_heads, dtype=torch.long, device=dev)
pos = torch.zeros(1, dtype=torch.long, device=dev)
cache = [(torch.zeros(batch_heads, positions, head_dim, device=dev),
          torch.zeros(batch_heads, positions, head_dim, device=dev)) for _ in range(2)]
torch_xla.sync()
# Native reads' self-test compiles one small graph at the process's first
# read (README, Native reads): done here, so that the count is the decode's.
from torch_xla_donate import _xla as reads; reads.tensor_id(pos)
compiles_before = met.metric_data("CompileTime")[0]
""",
        check="""
tdx.settle()
totals = tdx.summary().totals
assert totals.donated == totals.reused == new_tokens * 4, totals  # 2 layers, k and v
assert pos.cpu().tolist() == [new_tokens] and ids.shape == (batch_heads,)
# "one graph for all steps": the decode step compiled once.
assert met.metric_data("CompileTime")[0] - compiles_before == 1
""",
    ),
}


@dataclass
class Block:
    readme: str
    line: int  # of the opening fence
    lang: str
    source: str
    marker: str | None = None
    text: str | None = None  # a ```text block right after it
    end: int = 0  # the line after the closing fence

    @property
    def id(self):
        return f"{self.readme}:{self.line}"


_FENCE = re.compile(r"^```(\w*)\s*$")
_MARKER = re.compile(r"^<!--\s*readme-test:\s*(.*?)\s*-->\s*$")


def fenced_blocks(text: str, readme: str) -> list:
    """The fenced blocks of a Markdown text, each with the readme-test marker
    on the last non-blank line before it, and a ```text block right after."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        prev = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(prev)
        block = Block(readme, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n",
                      marker.group(1) if marker else None)
        if blocks and blocks[-1].lang == "python" and block.lang == "text" and \
                all(not s.strip() for s in lines[blocks[-1].end:i]):
            blocks[-1].text = block.source
        block.end = end + 1
        blocks.append(block)
        i = end + 1
    return blocks


def _python_blocks():
    out = []
    for readme in READMES:
        path = REPO / readme
        if path.exists():
            out += [b for b in fenced_blocks(path.read_text(), readme) if b.lang == "python"]
    return out


BLOCKS = _python_blocks()


def test_the_readme_has_its_blocks():
    """The extraction finds the blocks (the API import, the loop, the decode
    step, the worked example): a parser that found none would pass all."""
    assert len([b for b in BLOCKS if b.readme == "README.md"]) >= 4


def _setup_of(block):
    if block.marker is None:
        return None
    kind, _, arg = block.marker.partition(" ")
    if kind == "skip":
        assert arg in SKIP_REASONS, f"{block.id}: skip reason {arg!r} not in SKIP_REASONS"
        pytest.skip(f"{block.id}: {arg}")
    name = block.marker.removeprefix("setup=")
    assert block.marker.startswith("setup=") and name in SETUPS, \
        f"{block.id}: unknown marker {block.marker!r} (setups: {sorted(SETUPS)})"
    return SETUPS[name]


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_readme_block_runs_and_prints_what_it_says(block, tmp_path):
    setup = _setup_of(block)
    spec = {"source": block.source, "text": block.text,
            "prelude": setup and setup.prelude, "fill": setup and setup.fill,
            "check": setup and setup.check}
    path = tmp_path / "block.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, str(RUNNER), str(path)], cwd=tmp_path,
                          env=dict(os.environ, PJRT_DEVICE="CPU", PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"{block.id} failed:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-5000:]}")


def test_the_readme_starts_with_its_two_commands_and_ci_runs_the_second():
    """Title, one line, then exactly the two commands in a fenced block; CI
    calls the second."""
    text = (REPO / "README.md").read_text()
    lines = text.splitlines()
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2] and lines[3] == ""
    first = fenced_blocks(text, "README.md")[0]
    assert first.line == 5 and first.lang == "bash"
    commands = [ln.split("#", 1)[0].strip() for ln in first.source.splitlines()]
    assert [c for c in commands if c] == ["bash tools/dev.sh example", "bash tools/dev.sh test"]
    ci = [ln for ln in (REPO / ".ci/run").read_text().splitlines()
          if ln.strip() and not ln.startswith(("#", "set ", "cd "))]
    assert len(ci) == 1 and ci[0].startswith("bash tools/dev.sh test"), ci


def test_markers_name_a_setup_or_an_allowed_skip():
    for block in BLOCKS:
        if block.marker and not block.marker.startswith("skip"):
            assert block.marker.removeprefix("setup=") in SETUPS, block.id


def test_the_fence_parser_pairs_markers_and_text_blocks():
    text = ("<!-- readme-test: setup=kv_cache -->\n```python\nprint(1)\n```\n\n```text\n1\n```\n"
            "```python\nx = 1\n```\n")
    a, _, b = fenced_blocks(text, "T.md")
    assert (a.marker, a.text, a.source) == ("setup=kv_cache", "1\n", "print(1)\n")
    assert (b.marker, b.text, b.line) == (None, None, 9)


_RIGHT_AND_WRONG = {  # a kind of claim: (a block that keeps it, the same block breaking it)
    "literal": ("x = 2\nx + 1  # 3\n", "x = 2\nx + 1  # 4\n"),
    "raises": ("int('x')  # ValueError, with:\n# invalid literal ... 'x'\n",
               "int('7')  # ValueError, with:\n# invalid literal ... 'x'\n"),
    "message": ("int('x')  # ValueError, with:\n# invalid literal ... 'x'\n",
                "int('y')  # ValueError, with:\n# invalid literal ... 'x'\n"),
    "print": ("print('step', 2)  # step 2\n", "print('step', 3)  # step 2\n"),
    "text": ("print('a 1'); print('b')\n", "print('a 1'); print('c')\n"),
    "fill": ("def f():\n    ...\n    return y\nf()  # 5\n", "def f():\n    ...\n    return y\nf()  # 6\n"),
}


@pytest.mark.parametrize("kind", sorted(_RIGHT_AND_WRONG))
def test_the_runner_holds_each_kind_of_claim(kind):
    """Each kind of claim passes as written and fails when the code says
    otherwise (in this process: plain Python, no device)."""
    import warnings

    sys.path.insert(0, str(RUNNER.parent))
    try:
        import readme_runner
    finally:
        sys.path.remove(str(RUNNER.parent))
    right, wrong = _RIGHT_AND_WRONG[kind]
    extra = {"text": "a ...\nb\n" if kind == "text" else None,
             "fill": "y = 5" if kind == "fill" else None}
    with warnings.catch_warnings():
        readme_runner.run_block(dict(source=right, **extra))
        with pytest.raises(readme_runner.ClaimFailed):
            readme_runner.run_block(dict(source=wrong, **extra))
