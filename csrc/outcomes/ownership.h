// Who else holds a marked tensor (torch_xla_donate/_outcomes/ownership.py):
// the native walk of the live objects its scan starts from.
#pragma once

#include <Python.h>

namespace torch_xla_donate {

// Registers live_objects on `module`.
void RegisterOwnership(PyObject* module);

}  // namespace torch_xla_donate
