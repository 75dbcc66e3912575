"""Which torch_xla releases the plugin runs on, and the few places where they
differ.

Supported: torch_xla 2.7, 2.8 and 2.9, each with the torch release of the
same number (torch_xla wheels do not declare it, so a mismatch installs
silently and fails in odd places).  torch_xla 2.6 and older ignore explicit
donor flags at the step barrier (honoured from 2.7, pytorch/xla#8982): the
core cannot work there, and importing the plugin says so.

Differences are found by looking at what torch_xla offers, not by version
numbers scattered through the code:

* ``gradient_accumulation`` takes the carried tensors as varargs from 2.8
  (``gradient_accumulation(step, xs, model, *carried)``) and as one tuple
  before (``gradient_accumulation(step, xs, model, carried)``):
  ``call_gradient_accumulation`` calls it either way.
* torch_xla 2.7 loses a donated buffer when the step that donates it fails
  to compile (2.8 keeps it): not a feature to detect but an outcome to
  observe, which verdicts.py does for every release (verdict LOST).

>>> check_versions("2.9.0+cu128", "2.9.0")
>>> check_versions("2.8.0", "2.8.1")
>>> check_versions("2.6.0", "2.6.0")
Traceback (most recent call last):
ImportError: torch_xla_donate needs torch_xla 2.7, 2.8 or 2.9; this is torch_xla 2.6.0, ...
"""
import inspect
import re

__all__ = ["SUPPORTED", "release", "check_versions", "check_build", "call_gradient_accumulation",
           "carried_as_varargs"]

SUPPORTED = ((2, 7), (2, 8), (2, 9))


def release(version: str):
    """(major, minor) of a version string.

    >>> release("2.9.0+cu128"), release("2.7.0rc1"), release("nightly")
    ((2, 9), (2, 7), None)
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_versions(torch_version: str, torch_xla_version: str) -> None:
    """Raises ImportError, saying what to install, unless this torch_xla is
    supported and torch is its matching release."""
    xla, torch_release = release(torch_xla_version), release(torch_version)
    names = ", ".join(f"{a}.{b}" for a, b in SUPPORTED[:-1]) + f" or {'.'.join(map(str, SUPPORTED[-1]))}"
    if xla not in SUPPORTED:
        older = xla is not None and xla < SUPPORTED[0]
        why = (" torch_xla 2.6 and older ignore explicit donor flags at the step barrier "
               "(honoured from 2.7, pytorch/xla#8982)." if older else "")
        raise ImportError(
            f"torch_xla_donate needs torch_xla {names}; this is torch_xla "
            f"{torch_xla_version}, with torch {torch_version}.{why} Install a supported "
            f"release with its own torch: pip install 'torch==2.9.0' 'torch_xla==2.9.0'.")
    if torch_release != xla:
        raise ImportError(
            f"torch_xla {torch_xla_version} is built for torch {xla[0]}.{xla[1]}, but torch "
            f"{torch_version} is installed (torch_xla's wheels do not pin it, so pip "
            f"allows the mismatch). Install the matching torch: "
            f"pip install 'torch=={xla[0]}.{xla[1]}.*'.")


def check_build(built_for, torch_version: str) -> None:
    """Raises ImportError unless the native extension was built against this
    torch (its ABI follows torch; a checkout switched between releases keeps
    the extension of the last build).

    >>> check_build("2.9.0+cu128", "2.9.0+cu128"); check_build(None, "2.8.0")
    >>> check_build("2.7.0", "2.9.0")
    Traceback (most recent call last):
    ImportError: torch_xla_donate's extension was built against torch 2.7.0, ...
    """
    if built_for is not None and built_for != torch_version:
        raise ImportError(
            f"torch_xla_donate's extension was built against torch {built_for}, but torch "
            f"{torch_version} is installed. Rebuild it in this environment: "
            f"pip install --no-build-isolation -e . (or TDX_TORCH_XLA=<release> bash "
            f"tools/dev.sh test, which does).")


def carried_as_varargs(gradient_accumulation) -> bool:
    """True when ``gradient_accumulation`` takes carried tensors as
    ``*carried_tensors`` (torch_xla 2.8 and later), False for one tuple."""
    params = inspect.signature(gradient_accumulation).parameters.values()
    return any(p.kind == p.VAR_POSITIONAL for p in params)


def call_gradient_accumulation(gradient_accumulation, train_step, iterable_tensors, model,
                               *carried):
    """``gradient_accumulation`` with the carried tensors in the form this
    torch_xla takes them."""
    if carried_as_varargs(gradient_accumulation):
        return gradient_accumulation(train_step, iterable_tensors, model, *carried)
    return gradient_accumulation(train_step, iterable_tensors, model, tuple(carried))
