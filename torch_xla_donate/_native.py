"""The one owner of the native library ``_C``, and the releases it runs on: torch_xla 2.7,
2.8 and 2.9, each with the torch of its release (torch_xla's wheels do not pin it).

>>> check_versions("2.6.0", "2.6.0")
Traceback (most recent call last):
ImportError: torch_xla_donate needs torch_xla 2.7, 2.8 or 2.9; this is torch_xla 2.6.0, ...
"""
import inspect
import re

import torch
import torch_xla

from . import _C as C

__all__ = ["C", "Verdict", "Via", "lock", "SUPPORTED", "release", "check_versions",
           "check_build", "call_gradient_accumulation"]

SUPPORTED = ((2, 7), (2, 8), (2, 9))


def release(version: str):
    """(major, minor) of a version string.

    >>> release("2.9.0+cu128"), release("2.7.0rc1"), release("nightly")
    ((2, 9), (2, 7), None)
    """
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def check_versions(torch_version: str, torch_xla_version: str) -> None:
    """ImportError, saying what to install, unless this torch_xla is supported and torch its release."""
    xla, torch_release = release(torch_xla_version), release(torch_version)
    if xla not in SUPPORTED:
        why = (" torch_xla 2.6 and older ignore explicit donor flags at the step barrier "
               "(honoured from 2.7, pytorch/xla#8982)." if xla and xla < SUPPORTED[0] else "")
        raise ImportError(f"torch_xla_donate needs torch_xla 2.7, 2.8 or 2.9; this is torch_xla "
                          f"{torch_xla_version}, with torch {torch_version}.{why} Install a supported "
                          "release with its own torch: pip install 'torch==2.9.0' 'torch_xla==2.9.0'.")
    if torch_release != xla:
        raise ImportError(f"torch_xla {torch_xla_version} is built for torch {xla[0]}.{xla[1]}, but "
                          f"torch {torch_version} is installed (torch_xla's wheels do not pin it, so "
                          f"pip allows the mismatch). Install the matching torch: pip install "
                          f"'torch=={xla[0]}.{xla[1]}.*'.")


def check_build(built_for, torch_version: str) -> None:
    """ImportError unless the extension was built against this torch (a
    checkout switched between releases keeps its last build)."""
    if built_for is not None and built_for != torch_version:
        raise ImportError(f"torch_xla_donate's extension was built against torch {built_for}, but "
                          f"torch {torch_version} is installed. Rebuild it in this environment: pip "
                          "install --no-build-isolation -e . (or TDX_TORCH_XLA=<release> bash "
                          "tools/dev.sh test, which does).")


def call_gradient_accumulation(gradient_accumulation, train_step, iterable_tensors, model, *carried):
    """``gradient_accumulation`` with the carried tensors as this torch_xla
    takes them: ``*carried_tensors`` from 2.8, one tuple in 2.7."""
    params = inspect.signature(gradient_accumulation).parameters.values()
    if not any(p.kind == p.VAR_POSITIONAL for p in params):
        carried = (tuple(carried),)
    return gradient_accumulation(train_step, iterable_tensors, model, *carried)


check_versions(torch.__version__, torch_xla.__version__)
check_build(C.BUILT_FOR_TORCH, torch.__version__)

Verdict, Via = C.Verdict, C.Via
# The commit lock, native: marking sees a commit in progress on another
# thread (Refusal.COMMITTING) and waits for it.
lock = C.lock
