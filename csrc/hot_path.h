// The per-tensor hot path: marking, and the batch helpers of a commit.
//
// Marking only records: torch_xla's donor flag is set by `arm` inside the
// execution that commits the marks (see torch_xla_donate/commit.py), on the
// buffer each tensor holds at that moment, and cleared by `disarm` as soon
// as that execution has built its graph.  Each batch helper replaces one
// Python loop and does what that loop did, entry by entry.
#pragma once

#include <Python.h>

namespace torch_xla_donate {

// Registers try_mark, try_mark_all, is_donatable and the batch helpers
// (split_committed, arm, disarm, poison_donors, settle_entries) and the
// fast-path switches on `module`.
void RegisterHotPath(PyObject* module);

}  // namespace torch_xla_donate
