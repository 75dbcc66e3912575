// The TensorImpl behind a torch tensor's Python object, read in place.
//
// The hot path needs the c10::TensorImpl of every donated tensor several
// times per step (marking, the commit's split, the unreachable test).  The
// Python route, `t._cdata`, costs an attribute lookup through the tensor's
// long MRO and torch's error-handling getter, about 0.3 us; the object
// itself holds the answer.
#pragma once

#include <Python.h>

#include <cstdint>

namespace torch_xla_donate {

// The address of `t`'s c10::TensorImpl (what `t._cdata` gives).  `t` must
// be an instance of torch.Tensor (IsTensor): nothing is checked.
uintptr_t VariableImplAddress(PyObject* t);

}  // namespace torch_xla_donate
