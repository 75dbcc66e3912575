// Poisoning a step's donors natively (see hooks/commit.h): the donated key
// on the tensor torch_xla computes with, the twin class on the user's.
//
// The poisoned twin classes come from poison.py through the bound hook
// `poison_class_for` (once per class): Python owns the classes, this file
// only applies them.
#pragma once

#include <Python.h>

#include <string>

#include "base/ledger.h"

namespace torch_xla_donate {

// Tags t's TensorImpl with `record` (record_tag.h).  0 ok, -1 error.
int TagTensor(PyObject* t, const RecordPtr& record, const std::string& note = std::string());
// Makes `t` refuse every use (poison.py): the tensor torch_xla computes
// with (the one a functional tensor wraps) is tagged with the record and
// takes the donated key; then `t` takes the twin of its own class.  `note`
// says how a companion lost its buffer (poison.py).  0 ok, -1 error.
int Poison(PyObject* t, const RecordPtr& record, const std::string& note = std::string());
// Gives a poisoned `t` back its class and its TensorImpl's key set: its
// donation went unused.  0 ok, -1 error.
int Unpoison(PyObject* t);
// Makes the deaths of `cls`'s instances (a poisoned twin class of
// poison.py's) let go at once of what entries keep of them weakly
// (py_types.h WeakenedTensorDying), not at the next barrier; after the
// finalizer (`__del__`) it inherited, if any.  False if `cls` is no class.
bool WatchDeaths(PyObject* cls);

}  // namespace torch_xla_donate
