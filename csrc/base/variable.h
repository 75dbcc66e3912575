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

namespace at {
class TensorBase;
}

namespace torch_xla_donate {

// The address of `t`'s c10::TensorImpl (what `t._cdata` gives).  `t` must
// be an instance of torch.Tensor (IsTensor): nothing is checked.
uintptr_t VariableImplAddress(PyObject* t);

// torch's `t._is_view()` and `t.is_leaf and t.requires_grad` (a leaf
// autograd accumulates gradients into), read natively.  `t` must be an
// instance of torch.Tensor.
bool IsView(PyObject* t);
bool AccumulatesGrad(PyObject* t);

// The address of the TensorImpl the functional wrapper `t` wraps (the one
// torch_xla computes with), or 0 when `t` is no functional tensor.
uintptr_t FunctionalInnerImpl(PyObject* t);

// Whether the tensor the functional wrapper `t` wraps has a Python object
// (false for anything else): tests of poisoning, which makes none.
bool FunctionalInnerHasObject(PyObject* t);

// torch's THPVariable_Wrap: the Python object of `t` (a new reference, made
// if it has none), or nullptr with an error when that function is missing.
PyObject* WrapTensor(const at::TensorBase& t);

// Weak references to a tensor kept in c10's own count on its TensorImpl,
// not in a Python weak reference: a Python object is one more allocation
// the garbage collector counts, and in a loop that holds its old state
// through the barrier the plugin's per-donor objects were what pushed every
// step over the collector's threshold (benchmarks/README.md).
//
// Takes a weak reference to `t`'s TensorImpl and returns its address, or 0
// (nothing taken) when the Python object could not be found again
// (torch's THPVariable_Wrap not found).
uintptr_t WeakTensorTake(PyObject* t);
// Lets go of a reference WeakTensorTake took.  May destroy the TensorImpl
// (what the tensor held until then); needs the GIL.
void WeakTensorDrop(uintptr_t impl);
// Whether the tensor still lives: its TensorImpl, and a Python object for
// it (the one the user holds, or the one torch keeps for a TensorImpl that
// C++ still holds), as a Python weak reference to that object would say.
bool WeakTensorAlive(uintptr_t impl);
// That Python object (a new reference), or nullptr, no error, once it died.
PyObject* WeakTensorObject(uintptr_t impl);

}  // namespace torch_xla_donate
