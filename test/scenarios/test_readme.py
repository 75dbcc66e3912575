"""Every ```python block of the READMEs and of docs/ runs, and says what it
prints; every relative link and image of those pages resolves.

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

Links: every ``[text](target)`` and ``![alt](target)`` outside code whose
target is relative must name a file that exists, and a ``#anchor`` must be a
heading of the target (GitHub's slugs).
"""
import json
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import pytest
from helpers import REPO, child_env

DOCS = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))
READMES = ["README.md", *DOCS, "benchmarks/README.md"]
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
    # README "torch.func": the tutorial's detached parameters, a loss through
    # functional_call, three batches; every step donates both parameters.
    "func": Setup(
        prelude="""
import torch, torch_xla
import torch_xla_donate as tdx

dev = torch_xla.device()
gen = torch.Generator().manual_seed(0)
model = torch.nn.Linear(64, 8).to(dev)
batches = [(torch.randn(16, 64, generator=gen).to(dev), torch.randn(16, 8, generator=gen).to(dev))
           for _ in range(3)]
torch_xla.sync()

def loss_fn(params, x, y):
    return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()
""",
        check="""
tdx.settle()
totals = tdx.summary().totals
assert totals.donated == totals.reused == 3 * 2, totals
# The module's own parameters went down with the first donation.
try:
    model(batches[0][0])
except tdx.DonatedBufferError:
    pass
else:
    raise AssertionError("model(x) did not raise DonatedBufferError")
assert torch.isfinite(torch.func.functional_call(model, params, (batches[0][0],))).all()
""",
    ),
    # README "torch.compile": a compiled functional update; the call commits
    # the marks of its arguments, with no barrier of its own.
    "compile": Setup(
        prelude="""
import torch, torch_xla
import torch_xla_donate as tdx

dev = torch_xla.device()
params = [torch.randn(256, 256).to(dev) for _ in range(3)]
grads = [torch.ones(256, 256, device=dev) for _ in range(3)]
torch_xla.sync()
old = params
""",
        check="""
tdx.settle()
totals = tdx.summary().totals
assert totals.donated == totals.reused == 3, totals
assert all(tdx.is_deleted(t) for t in old)
""",
    ),
    # docs/buffer-sharing.md "What you do": a target network loaded from
    # clones, then the policy's (torch.func) parameters donated.
    "sharing": Setup(
        prelude="""
import torch, torch_xla
import torch_xla_donate as tdx

dev = torch_xla.device()
policy = torch.nn.Linear(32, 32).to(dev)
target = torch.nn.Linear(32, 32).to(dev)
torch_xla.sync()
""",
        check="""
# The target kept its own buffers: still readable, half the new policy.
for k, v in target.state_dict().items():
    assert torch.allclose(v.cpu() * 0.5, params[k].cpu()), k
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
                          env=child_env(),
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


# ---- Links: every relative link and image of the pages resolves. ----

_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_lines(text: str):
    """(line number, line) outside fenced code, inline code spans blanked."""
    fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line) or line.strip() == "```":
            fence = not fence
            continue
        if not fence:
            yield n, re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lower-cased, Markdown marks and
    punctuation other than ``-`` and ``_`` dropped, spaces made ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"[`*]|<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors_of(text: str) -> set:
    """Every heading's anchor (repeated headings get -1, -2, ... as on GitHub),
    and any explicit ``<a name=...>`` / ``id=...``."""
    seen, out, fence = {}, set(), False
    for line in text.splitlines():
        if _FENCE.match(line) or line.strip() == "```":
            fence = not fence
            continue
        m = None if fence else _HEADING.match(line)
        if m:
            slug = github_slug(m.group(2))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    out.update(re.findall(r"""<a\s+(?:name|id)=["']([^"']+)["']""", text))
    return out


def broken_links(page: pathlib.Path, root: pathlib.Path = REPO) -> list:
    """The relative links and images of ``page`` that do not resolve."""
    text, out = page.read_text(), []
    for n, line in _prose_lines(text):
        for target in _LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue  # https:, mailto:: not checked here
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(root)}:{n}: ({target})"
            try:
                rel = str(dest.relative_to(root))
            except ValueError:
                out.append(f"{where} points outside the repository")
                continue
            if not dest.exists():
                out.append(f"{where}: no file {rel}")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors_of(dest.read_text()):
                out.append(f"{where}: no heading #{anchor} in {rel}")
    return out


@pytest.mark.parametrize("page", READMES)
def test_every_relative_link_and_image_resolves(page):
    assert broken_links(REPO / page) == []


def test_the_readme_links_every_docs_page_and_shows_a_chart():
    """A page in docs/ that no reader can reach from the README is lost."""
    text = (REPO / "README.md").read_text()
    linked = {(REPO / t.partition("#")[0]).resolve() for _, line in _prose_lines(text)
              for t in _LINK.findall(line)}
    pages = {REPO / p for p in DOCS}
    assert {p for p in pages if p.resolve() not in linked} == set()
    assert re.search(r"!\[[^\]]*\]\(benchmarks/results/\w+\.png\)", text)
    assert len(text.splitlines()) <= 300


def test_the_link_checker_finds_what_is_broken(tmp_path):
    """It fails on a missing file, a missing anchor and a missing image, and
    not on links that resolve or on code."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Page A\n\n## The `x_y` part: why?\n\n## Twice\n\n## Twice\n")
    (tmp_path / "img.png").write_bytes(b"")
    page = tmp_path / "README.md"
    page.write_text(
        "# T\n\n[ok](docs/a.md) [ok](docs/a.md#the-x_y-part-why) [ok](docs/a.md#twice-1)\n"
        "![ok](img.png) [ok](#t) [web](https://example.com/x)\n"
        "`[code](nowhere.md)`\n```\n[code](nowhere.md)\n```\n"
        "[bad](docs/b.md) [bad](docs/a.md#nope) ![bad](img2.png) [bad](#nope)\n")
    found = broken_links(page, root=tmp_path)
    assert [f.split(": (")[1].split(")")[0] for f in found] == \
        ["docs/b.md", "docs/a.md#nope", "img2.png", "#nope"], found


# ---- What a reader reads once: short sentences, no lab notebook. ----

def test_the_readme_reads_in_short_sentences():
    """README prose: at most 25 words a sentence on average, at most five
    sentences over 45 words (tools/prose_stats.py)."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import prose_stats
    finally:
        sys.path.remove(str(REPO / "tools"))
    stats = prose_stats.stats((REPO / "README.md").read_text())
    assert stats["sentences"] > 30 and stats["mean"] <= 25, stats["mean"]
    assert len(stats["long"]) <= 5, stats["long"]


@pytest.mark.parametrize("page", READMES)
def test_no_commit_hashes_or_utc_times_outside_the_history(page):
    """Dated runs and the commits they measured belong in benchmarks/HISTORY.md."""
    found = []
    for n, line in enumerate((REPO / page).read_text().splitlines(), 1):
        for word in re.findall(r"\b[0-9a-f]{7,40}\b", line):
            if re.search(r"[a-f]", word) and re.search(r"[0-9]", word):
                found.append(f"{page}:{n}: {word}")
        if re.search(r"\bUTC\b|\b\d{1,2}:\d{2}\b", line):
            found.append(f"{page}:{n}: {line.strip()[:80]}")
    assert found == []
