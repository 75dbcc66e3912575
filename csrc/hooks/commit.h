// The batch helpers of a commit (torch_xla_donate/_hooks/commit.py): each
// replaces one Python loop over a step's donors and does what that loop
// did, entry by entry.  Marking only records; `arm` sets torch_xla's donor
// flag inside the execution that commits the marks, on the buffer each
// tensor holds at that moment, and `disarm_and_poison` clears it as soon as
// that execution has built its graph, unless a donor is kept by its buffer
// alone: then the verdict, or the next execution's commit while the user
// still holds the tensor, clears it (`live_held`, `disarm_held`), if the
// buffer was not consumed.
#pragma once

#include <Python.h>

namespace torch_xla_donate {

// Registers split_committed, arm, disarm, disarm_and_poison, live_held,
// disarm_held and settle_entries on `module`.
void RegisterCommit(PyObject* module);

}  // namespace torch_xla_donate
