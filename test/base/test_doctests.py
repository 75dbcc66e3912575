"""Every module's docstring examples hold (each helper's docstring carries a
small one, for the tricky case it exists for), the benchmarks' helpers'
too: a benchmark's verdict is only as good as its arithmetic."""
import doctest
import importlib
import importlib.util
import pathlib
import pkgutil
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
def test_benchmark_docstring_examples(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # bench_async imports _common
    spec = importlib.util.spec_from_file_location(f"_tdx_bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"benchmarks/{name}.py has no docstring example"
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed"
