"""The self-test that lets native reads (``reads.py``) on: every native read
must agree with ``_XLAC`` on tensors in each state the plugin meets.

Run once per process, at the first read of an XLA tensor (so importing the
package never starts the runtime), on that tensor's device:

* *fresh*: moved from the CPU, no step has read it (its value lives in a
  ``device_data`` IR node, no handle yet; under SPMD it is host data, which
  the native read declines: that is allowed);
* *traced*: the output of a step (a handle, no IR);
* *pending*: a lazy op not run yet;
* *copy*: ``t.to(dev, copy=True)`` of a traced tensor (torch_xla backs it
  with its source's buffer);
* *consumed*: donated with torch_xla's raw ``_set_buffer_donation`` and
  synced (buffer deleted).

What it leaves behind: nothing of the user's.  It syncs only its own
tensors, with torch_xla's own ``_xla_sync_multi`` (not the plugin's
trampoline: no marks are committed, no other live tensor runs), waits for
them, arms no donor flag that outlives it and drops every tensor it made.
It costs one small compiled graph.

Tests corrupt one native answer through ``CORRUPT`` (a field of
``LazyFacts``, or ``query_owner``) to see a mismatch turn native reads off.

>>> describe_mismatch("fresh", "tensor_id", 3, 2)
'tensor_id of a fresh tensor: native 3, _XLAC 2'
"""
import torch

from . import xla
from .native import C

__all__ = ["run", "describe_mismatch", "CORRUPT"]

# Test hook: the name of a LazyFacts field (or "query_owner") whose native
# answer the self-test adds 1 to (None: off).
CORRUPT = None


def describe_mismatch(state: str, what: str, native, xlac) -> str:
    return f"{what} of a {state} tensor: native {native}, _XLAC {xlac}"


def _scenarios(device):
    """[(state, tensor)] in each state, on ``device``; waits for their step."""
    fresh = torch.arange(6.0).reshape(2, 3).to(device)
    traced = torch.arange(6.0).reshape(2, 3).to(device) + 1
    donor = torch.ones(2, 3).to(device)
    if not xla.real("_set_buffer_donation")(donor, False):
        # Under SPMD a tensor moved from the CPU stays host data until a step
        # reads it, and cannot be a donor: one more small graph makes it
        # device data (elsewhere the self-test compiles one graph only).
        donor = donor * 2
        xla.real("_xla_sync_multi")([donor], devices=[], wait=True, sync_xla_data=True)
        xla.wait_device_ops(device)
    if not xla.real("_set_buffer_donation")(donor, True):
        raise RuntimeError("torch_xla refused the self-test's donor flag")
    try:
        out = donor * 3
        xla.real("_xla_sync_multi")([traced, out, donor], devices=[], wait=True,
                                    sync_xla_data=True)
        xla.wait_device_ops(device)
    finally:
        if not xla.buffer_deleted(donor):  # aliasing off: no flag may stay armed
            xla.real("_set_buffer_donation")(donor, False)
    pending = traced * 2
    copy = traced.to(device, copy=True)
    return [("fresh", fresh), ("traced", traced), ("pending", pending), ("copy", copy),
            ("consumed", donor), ("output", out)]


def _native(t):
    """``t``'s native facts (a dict), or None when the read declines."""
    facts = C.lazy_facts(t, force=True)
    if facts is None:
        return None
    facts = dict(zip(C.LAZY_FACT_FIELDS, facts))
    if CORRUPT in facts:
        facts[CORRUPT] = 1 if facts[CORRUPT] is None else facts[CORRUPT] + 1
    return facts


def _query_owner(t) -> int:
    """What torch_xla's owner query would answer for ``t`` now, read
    natively without its side effects."""
    owner = C.lazy_owner_ids([t], force=True)[0]
    if CORRUPT == "query_owner":
        owner += 1
    return owner


def _compare(state: str, t, n: dict) -> str | None:
    """The first disagreement of ``t``'s native facts ``n`` with ``_XLAC``."""
    checks = [("tensor_id", n["tensor_id"], xla.tensor_id(t)),
              ("pending", n["pending"], xla.has_pending_ir([t])[0])]
    if not n["pending"]:
        consumed = n["has_handle"] and not n["has_value"]
        checks.append(("consumed", consumed, xla.buffer_deleted(t)))
        if n["has_value"]:
            checks.append(("handle", n["handle"], xla.buffer_handles([t])[0]))
            # Last: torch_xla's owner query caches an IR value on the tensor
            # (and may file its buffer under it).  torch_xla 2.7 under SPMD
            # files the buffer under a new tensor the query makes: a buffer
            # shared with a tensor compared before (a copy and its source)
            # then has a new owner, so the prediction is read again now.
            owner = _query_owner(t)
            checks.append(("owner", xla.NO_OWNER if owner == -1 else owner,
                           xla.buffer_owner_ids([t])[0]))
    for what, native, expected in checks:
        if native != expected:
            return describe_mismatch(state, what, native, expected)
    return None


def run(sample) -> str | None:
    """Learns the XLA tensor type from ``sample`` (an XLA tensor) and tests
    every native read; None when all agree, else why not."""
    why = C.lazy_learn(sample)
    if why:
        return why
    scenarios = _scenarios(sample.device)
    try:
        # Every native read first: torch_xla's answers change some states.
        read = [(state, t, _native(t)) for state, t in scenarios]
        for state, _, facts in read:
            # A fresh tensor may be host data (SPMD): declined, _XLAC answers.
            if facts is None and state != "fresh":
                return f"the native read declined a {state} tensor"
        read = [entry for entry in read if entry[2] is not None]
        states = {state: facts for state, _, facts in read}
        if states["copy"]["buffer"] != states["traced"]["buffer"]:
            return "a copy and its source read different buffers"
        for state, t, facts in read:
            try:
                mismatch = _compare(state, t, facts)
            except Exception as error:  # asked _XLAC what the native read got wrong
                mismatch = f"_XLAC raised on a {state} tensor the native read found usable: {error}"
            if mismatch:
                return mismatch
        return None
    finally:
        del scenarios
