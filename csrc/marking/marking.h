// Marking's fast path: the twin of torch_xla_donate/_marking/checks.py and
// marks.py for the common case, in one call per tensor or tree.  It says
// "no" (changing nothing) whenever anything is unusual, and the Python path
// then decides and words the error; test/marking/test_marking_twins.py runs every
// tensor kind through both and compares.
//
// Marking only records: torch_xla's donor flag is set inside the execution
// that commits the marks (hooks/commit.h), on the buffer each tensor holds
// at that moment.
#pragma once

#include <Python.h>

namespace torch_xla_donate {

// Registers try_mark, try_mark_all, is_donatable and the fast path's
// switches (set_fast_path_enabled, note_lock, lock_holders,
// set_settled_ids) on `module`.
void RegisterMarking(PyObject* module);

}  // namespace torch_xla_donate
