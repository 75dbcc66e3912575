// torch_xla_donate._C's lazy_* functions: lazy_reads.h bound to Python.
#pragma once

#include <Python.h>

namespace torch_xla_donate {

void RegisterLazyReads(PyObject* module);

}  // namespace torch_xla_donate
