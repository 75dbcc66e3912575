// See variable.h.  The only file that includes torch's Python binding
// header (torch/csrc/autograd/python_variable.h, shipped in the torch
// wheel): the layout of a tensor's Python object comes from the torch this
// extension is built against, which the import checks it runs with.  Only
// inline code of that header is used; nothing links libtorch_python.
#include "base/variable.h"

#include <torch/csrc/autograd/python_variable.h>

namespace torch_xla_donate {

uintptr_t VariableImplAddress(PyObject* t) {
  return reinterpret_cast<uintptr_t>(THPVariable_Unpack(t).unsafeGetTensorImpl());
}

}  // namespace torch_xla_donate
