"""Every module's docstring examples hold (each helper's docstring carries a
small one, for the tricky case it exists for), the benchmarks' helpers'
too: a benchmark's verdict is only as good as its arithmetic."""
import doctest
import importlib
import pathlib
import pkgutil
import re
import subprocess
import sys

import pytest

import torch_xla_donate

MODULES = sorted(m.name for m in pkgutil.walk_packages(torch_xla_donate.__path__,
                                                        "torch_xla_donate.")
                 if not m.name.endswith("._C"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("name", ["_common", "bench_async"])
def test_benchmark_docstring_examples(name):
    # In a process of its own: importing a benchmark changes the process
    # (``sys.path``, its helpers' modules), and the fuzz test's fixed
    # examples, later in the suite, drew other programs after it.
    proc = subprocess.run([sys.executable, "-m", "doctest", "-v", str(BENCHMARKS / f"{name}.py")],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    passed = re.search(r"(\d+) passed and 0 failed", proc.stdout)
    assert passed and int(passed.group(1)) > 0, f"benchmarks/{name}.py has no docstring example"
