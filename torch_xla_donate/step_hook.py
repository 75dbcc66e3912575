"""Installing the plugin's hooks into torch_xla, and taking them out.

What the hooks do lives beside this module, one idea per file:

* ``executions.py``: which torch_xla executions commit donation marks, and
  the native trampolines that stand in for torch_xla's functions;
* ``commit.py``: committing marks to an execution (arm, run, disarm, poison);
* ``ownership.py``: tensors and graphs that hold a marked buffer;
* ``verdicts.py``: what became of each donation, and the unused warnings;
* ``failures.py``: failed executions keep their donated values;
* ``devices.py``: several devices in one process;
* ``dynamo.py``: ``torch.compile(backend="openxla")``;
* ``torchscript.py``: a donated tensor in TorchScript raises our error.

>>> import torch_xla_donate
>>> installed()
True
"""
from . import _C, commit, config, dynamo, executions, torchscript, verdicts
from .hook_lock import lock as _lock

__all__ = ["install", "uninstall", "installed", "settle_in_flight"]

settle_in_flight = verdicts.settle_in_flight


def install() -> None:
    """Routes torch_xla's executions through the plugin (idempotent)."""
    with _lock:
        executions.install(extra=dynamo.TRAMPOLINES)
        dynamo.install()
        torchscript.install()
        if commit.refresh_fast_path not in config.changed_listeners:
            config.changed_listeners.append(commit.refresh_fast_path)
        commit.refresh_fast_path()


def uninstall() -> None:
    """Takes the hooks out and cancels every mark: without the hooks nothing
    would commit them, and nothing may be left for torch_xla to find."""
    with _lock:
        for t in _C.marked_tensors():
            _C.unmark(t)
        torchscript.uninstall()
        dynamo.uninstall()
        executions.uninstall()
        _C.set_fast_path_enabled(False)


def installed() -> bool:
    return executions.installed()
