"""Every module's docstring examples hold (each helper's docstring carries a
small one, for the tricky case it exists for), the benchmarks' helpers'
too: a benchmark's verdict is only as good as its arithmetic."""
import doctest
import importlib
import importlib.util
import pathlib
import sys

import pytest

import torch_xla_donate

PACKAGE = pathlib.Path(torch_xla_donate.__file__).parent
# The modules with docstring examples: each must run at least one.
MODULES = sorted(f"torch_xla_donate.{p.stem}" for p in PACKAGE.glob("*.py")
                 if ">>> " in p.read_text())


def test_the_examples_are_found():
    assert len(MODULES) >= 5, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{name}'s examples are not in a docstring doctest reads"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"


BENCHMARKS = pathlib.Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("name", ["_common", "bench_async"])
def test_benchmark_docstring_examples(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # bench_async imports _common
    spec = importlib.util.spec_from_file_location(f"_tdx_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"benchmarks/{name}.py has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
