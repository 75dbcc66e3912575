"""Device buffers torch_xla shares between distinct tensors.

The problem
-----------
torch_xla backs some copies with their source's device buffer, and a
barrier does not give them one of their own: after
``target.load_state_dict(policy.state_dict())``, ``c = t.to(dev, copy=True)``,
``torch.tensor(t)``, ``x[...] = t`` or ``torch.empty_like(t).copy_(t)`` and a
step, both tensors hold one buffer (one ``_get_tensors_handle``), yet they
are distinct tensors with distinct storages, invisible to c10's use counts
(``.clone()``, ``t + 0`` get their own buffer).  Donating either destroys
the other.  The plugin never destroys what was not donated: a donor whose
buffer another live tensor holds is dropped at the commit (value kept,
``DroppedDonationWarning`` naming the other tensor and the fix).

What is seen, at what cost
--------------------------
* *The source of a copy* (the common case: the policy network donated in a
  functional update while a target network copied from it is alive).  When
  the copy took the buffer at a barrier, torch_xla filed the buffer under
  the copy's tensor id.  One vectorized query per commit
  (``xla.owner_suspects``) finds donors whose buffer is filed under another
  tensor; only for those the live tensors are looked at (a walk of the
  garbage collector's objects), to tell a live copy from a dead one.
  Always on.
* Under SPMD nothing is looked at: torch_xla crashes when asked about a
  sharded buffer still being computed.
* *The copy itself, or a copy made from a marked tensor since the last
  barrier*: nothing in the donor says so.  ``configure(check_sharing=True)``
  (or ``TORCH_XLA_DONATE_CHECK_SHARING=1``) compares every donor's handle
  with those of all live tensors at every commit that donates: exact for
  the tensors Python can reach, at the cost of that walk per step
  (``benchmarks/bench_sharing.py``).

>>> import torch_xla_donate as tdx
>>> tdx.configure(check_sharing=True)["check_sharing"]
False
>>> tdx.configure(check_sharing=False)["check_sharing"]
True
"""
import torch

from .._base import config, xla
from .._base.dtypes import shape_string
from . import ownership, poison

__all__ = ["screen", "live_sharers"]

# Owner ids whose tensor was looked for and not found alive: a buffer filed
# under one of them is its holder's alone (tensor ids are never reused).
_dead_owners = set()

_WHY = (
    "it shares its device buffer with {names}: torch_xla backs copies made by "
    "load_state_dict, copy_, t.to(device, copy=True), torch.tensor(t) or x[...] = t with "
    "their source's buffer, and donating it would destroy that tensor too. Make such "
    "copies with .clone() (a step gives a clone its own buffer)"
)


def screen(donors, notices) -> list:
    """The committed donors that hold their buffer alone, or share it only
    with other donors of the same step; the others are dropped (value kept,
    a warning held in ``notices``).  ``donors`` are (tensor, record) entries.

    Without ``check_sharing`` only donors torch_xla files under another
    tensor id are looked at; one whose other holder turns out to be dead is
    donated, and that owner id is not looked for again.
    """
    if not donors or xla.spmd():
        # torch_xla 2.9 crashes (SIGSEGV) asking the handle or the owner of a
        # sharded buffer that is still being computed (an output of a step
        # run with wait=False): tools/repros/sharded_inflight_query.py.
        return donors
    tensors = [t for t, _ in donors]
    if config.check_sharing():
        owners = {}
        suspects = list(range(len(donors)))
    else:
        # An owner of None: the answer does not say (some donors share one
        # buffer); those are looked at too.
        owners = dict(xla.owner_suspects(tensors))
        suspects = [i for i, owner in owners.items() if owner not in _dead_owners]
        if not suspects:
            return donors
    dropped = {}
    with ownership.scanning():  # one walk of the live objects, names included
        shared = live_sharers([tensors[i] for i in suspects], tensors)
        for i, sharers in zip(suspects, shared):
            if sharers:
                names = ", ".join(_name(o) for o in sharers[:3])
                if len(sharers) > 3:
                    names += f" and {len(sharers) - 3} more"
                dropped.setdefault(_WHY.format(names=names), []).append(donors[i])
            elif owners.get(i) is not None:
                _dead_owners.add(owners[i])
    for why, entries in dropped.items():
        ownership.drop(entries, why, notices)
    gone = {id(e) for entries in dropped.values() for e in entries}
    return [e for e in donors if id(e) not in gone]


def live_sharers(tensors, donors) -> list:
    """For each of ``tensors``: the live tensors Python can reach that hold
    its device buffer, apart from its own views and aliases (ownership.py
    judges those) and the step's other ``donors`` (donated with it)."""
    skip = {id(t) for t in donors}
    candidates = [o for o in ownership.scan().tensors if id(o) not in skip and _is_live_xla(o)]
    if candidates:
        # Without pending work, and with a buffer: not consumed (a donor only
        # the plugin's open verdicts still hold is not poisoned) nor still
        # being computed (a fresh output shares nothing).
        pending = xla.has_pending_ir(candidates)
        candidates = [o for o, p in zip(candidates, pending) if not p and not xla.buffer_deleted(o)]
    by_handle = {}
    for o, handle in zip(candidates, _handles(candidates)):
        if handle is not None:
            by_handle.setdefault(handle, []).append(o)
    out = []
    for t, handle in zip(tensors, _handles(tensors)):
        storage = ownership.storage_of(t)
        out.append([o for o in by_handle.get(handle, ()) if ownership.storage_of(o) != storage])
    return out


def _is_live_xla(o) -> bool:
    """An XLA tensor with a value: not consumed by a donation (its handle
    means nothing now), not a wrapper subclass (no buffer of its own)."""
    try:
        return (o.device.type == "xla" and not poison.is_poisoned(o)
                and not torch._C._dispatch_keys(o).has(torch._C.DispatchKey.Python))
    except RuntimeError:
        return False


def _handles(tensors) -> list:
    """The buffer handle of each tensor, None where torch_xla has none."""
    try:
        return list(xla.buffer_handles(tensors))
    except RuntimeError:
        out = []
        for t in tensors:
            try:
                out.append(xla.buffer_handles([t])[0])
            except RuntimeError:
                out.append(None)
        return out


def _name(t) -> str:
    name = ownership.scan().module_name(t)
    return f"the {name}" if name is not None else f"a tensor {shape_string(t)}"
