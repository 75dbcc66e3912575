"""Every module's docstring examples hold (each helper's docstring carries a
small one, for the tricky case it exists for)."""
import doctest
import importlib
import pkgutil

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
