// Poisoning, natively: the twin of torch_xla_donate/_outcomes/poison.py's
// `poison` that a commit runs for a whole step's donors in one call (see
// hooks/commit.h).  Kept in step with the Python one by
// test/outcomes/test_poison_twins.py.
//
// The poisoned twin classes come from poison.py through the bound hooks
// (`poison_class_for`, `dispatch_class_for`, once per class): Python owns
// the classes, this file only applies them.
#pragma once

#include <Python.h>

#include <string>

#include "base/ledger.h"

namespace torch_xla_donate {

// Tags t's TensorImpl with `record` (record_tag.h).  0 ok, -1 error.
int TagTensor(PyObject* t, const RecordPtr& record, const std::string& note = std::string());
// Makes `t` refuse every use (poison.py): the tensor torch_xla computes
// with (the one a functional tensor wraps) is tagged with the record, takes
// the twin of its class that refuses operators and the Python dispatch key;
// then `t` takes the twin of its own class.  0 ok, -1 error.  With
// `keep_inner`, a functional tensor's inner (a new reference) is handed to
// the caller there rather than let go (py_types.h EntryKeepInner); it is
// set only when 0 is returned and `t` had an inner.
int Poison(PyObject* t, const RecordPtr& record, PyObject** keep_inner = nullptr);
// Makes the deaths of `cls`'s instances (a poisoned twin class of
// poison.py's) let go at once of what entries keep of them weakly
// (py_types.h WeakenedTensorDying), not at the next barrier; after the
// finalizer (`__del__`) it inherited, if any.  False if `cls` is no class.
bool WatchDeaths(PyObject* cls);
// Drops the cache of poisoned twin classes (poison.py re-bound its hooks).
void ForgetPoisonClasses();

}  // namespace torch_xla_donate
