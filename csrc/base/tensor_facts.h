// What the hot path needs to know about a torch tensor, read natively.
//
// Asking these through torch's Python API costs more than the donation
// itself: `t.untyped_storage()` creates a Python storage object (2-5 us the
// first time, and one more object for the garbage collector per donated
// tensor and step), `t.device.type` a device object (1 us).  c10's own
// headers, which ship in the torch wheel, answer the same questions in
// nanoseconds.  This header keeps them out of the rest of csrc/: it needs
// only an address, and no torch type leaks out.
#pragma once

#include <cstdint>
#include <vector>

#include "base/dims.h"

namespace torch_xla_donate {

struct TensorFacts {
  bool is_xla = false;
  // A functional wrapper (torch_xla's default): an in-place update replaces
  // the XLA tensor it wraps, which then has a new torch_xla id.
  bool is_functional = false;
  // Tensors sharing the storage (1: no live views or aliases); 0 when the
  // tensor has no storage (a wrapper subclass).
  long storage_use_count = 0;
  // Owners of the TensorImpl itself: the Python tensor, plus C++ holders
  // such as an autograd graph that saved it for backward.
  long impl_use_count = 0;
  // False for a tensor that has never been touched by autograd (no
  // requires_grad, not a view): then it is certainly no view.
  bool has_autograd_meta = true;
  int scalar_type = -1;         // c10::ScalarType, -1 if not a plain scalar type
  bool symbolic_sizes = false;  // dynamic shapes: sizes below are not filled
  Dims sizes;
  int64_t itemsize = 0;
  // c10's version counter: every in-place update bumps it (-1: the tensor
  // keeps none, an inference tensor).
  int64_t version = -1;
};

// Reads the facts of the tensor whose c10::TensorImpl is at `impl` (the
// address torch's Python binding gives as `t._cdata`).  False if torch
// raised while answering (the caller then takes the Python route).  Without
// `with_sizes`, `sizes` stays empty: reading them asks the XLA tensor.
bool ReadTensorFacts(uintptr_t impl, TensorFacts* out, bool with_sizes = true);

// Whether the tensor at `impl` has c10's Python dispatch key: a subclass
// with its own __torch_dispatch__ (a wrapper), a FakeTensor.
bool HasPythonDispatch(uintptr_t impl);

// Whether the tensor at `impl` is a functional wrapper (its key set, read
// in place): ReadTensorFacts' is_functional alone.
bool IsFunctionalImpl(uintptr_t impl);

// The address of the c10::StorageImpl behind the tensor at `impl` (0: none).
// Two tensors share a storage (views, t.detach(), nn.Parameter(t)) exactly
// when these are equal.
uintptr_t StorageAddress(uintptr_t impl);

// Starts loading the two objects ReadTensorFacts reads beside the TensorImpl
// at `impl`, its storage and its version counter, once the impl itself has
// been loaded (tensor_access.h PrefetchTensors).  Reads two of its pointers.
void PrefetchTensorFacts(uintptr_t impl);

// True while the TensorImpl at `impl` owns its Python object: the object's
// last Python reference is gone and C++ (an autograd graph) keeps the
// tensor alive.  Code that finds such an object without torch's help (the
// garbage collector hands it out) must not keep it: it would outlive its
// TensorImpl.
bool PyObjectOwnedByTensor(uintptr_t impl);

}  // namespace torch_xla_donate
