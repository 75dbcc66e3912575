"""The examples run, learn, and donate."""
import importlib.util
import io
import os
import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"
TRAIN_DIGITS = EXAMPLES / "train_digits.py"


def _load(path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _number(pattern, text):
    match = re.search(pattern, text)
    assert match, f"{pattern!r} not found in:\n{text}"
    return float(match.group(1))


def test_train_digits_learns_and_donates_every_step():
    epochs = 5
    proc = subprocess.run(
        [sys.executable, str(TRAIN_DIGITS), "--epochs", str(epochs)],
        env=dict(os.environ, PJRT_DEVICE="CPU"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert _number(r"test accuracy: ([0-9.]+)", out) > 0.9
    steps = _number(r"epochs, (\d+) steps", out)
    state_tensors = _number(r"state \(params \+ Adam moments\): (\d+) tensors", out)
    state_bytes = _number(r"tensors, (\d+) bytes", out)
    donated = _number(r"donation: (\d+) buffers donated", out)
    reused = _number(r"(\d+) reused by step outputs", out)
    unused = _number(r"(\d+) unused", out)
    # Every step donated the whole training state and every buffer was
    # reused by an output (the ledger's verdict comes from torch_xla deleting
    # the donated buffer, not from the mark).
    assert donated == reused == steps * state_tensors
    assert unused == 0
    assert _number(r"reused bytes: (\d+) in total", out) == steps * state_bytes
    # The progress bar went to stderr: one line per epoch when not a terminal.
    bar_lines = [line for line in proc.stderr.splitlines() if re.match(r"epoch +\d+/", line)]
    assert len(bar_lines) == epochs
    assert "100.0%" in bar_lines[-1] and "loss" in bar_lines[-1]


def test_train_digits_checks_its_arguments():
    example = _load(TRAIN_DIGITS)
    assert example.parse_args(["--epochs", "3"]).epochs == 3
    assert example.parse_args(["--no-donate"]).donate is False
    with pytest.raises(SystemExit):
        example.parse_args(["--epochs", "0"])


def test_progress_bar_draws_in_place_on_a_terminal():
    example = _load(TRAIN_DIGITS)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    stream = Terminal()
    bar = example.ProgressBar(epochs=2, steps_per_epoch=4, stream=stream, width=8)
    bar.update(0, 4, loss=1.5, force=True)
    bar.update(1, 2, force=True)
    bar.close()
    frames = stream.getvalue().split("\r")[1:]
    assert len(frames) == 2
    assert "[####....]  50.0% loss 1.5000" in frames[0]
    # The loss stays until the next epoch; the second frame overwrites the first.
    assert "[######..]  75.0% loss 1.5000" in frames[1]
    assert len(frames[1].rstrip("\n")) >= len(frames[0])


def test_examples_use_only_the_public_api():
    import ast

    import torch_xla_donate

    public = set(torch_xla_donate.__all__)
    for path in sorted(EXAMPLES.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch_xla_donate"):
                assert node.module == "torch_xla_donate", f"{path.name} imports {node.module}"
                assert all(a.name in public for a in node.names), f"{path.name}: {ast.dump(node)}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert alias.name == "torch_xla_donate" or not alias.name.startswith(
                        "torch_xla_donate"), f"{path.name} imports {alias.name}"
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                  and node.value.id == "tdx"):
                assert node.attr in public, f"{path.name} uses tdx.{node.attr}"
