// The common step's commit in one native pass (_hooks/commit.py's
// `barrier_before`): begin the step, check every donor, walk for copies
// made in the step, arm.  The Python stages (split, sharing.screen, arm)
// keep every decision that is not the plain "donate them all": whenever a
// donor is anything but plain, the pass has changed nothing but begun the
// step, and hands the step's tensors and records to them.
#pragma once

#include <Python.h>

namespace torch_xla_donate {

// Registers commit_fast on `module`.
void RegisterCommitFast(PyObject* module);

}  // namespace torch_xla_donate
