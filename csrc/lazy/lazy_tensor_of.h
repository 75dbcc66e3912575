// The LazyTensor behind an XLA tensor, for native code that needs torch's
// lazy-tensor types themselves (live_tensors.cpp), not only lazy_reads.h's
// facts.  Same guard as ReadLazyFacts: only a learned XLATensorImpl (or an
// up-to-date functional wrapper of one) is read; the one torch_xla layout
// fact (where XLATensorImpl keeps its XLATensor) stays in lazy_reads.cpp.
//
// Includes torch's lazy-tensor headers: include it from .cpp files only.
#pragma once

#include <ATen/core/symbol.h>
#include <Python.h>
#include <torch/csrc/lazy/core/tensor.h>

#include <cstdint>
#include <string>

namespace torch_xla_donate {

// The LazyTensor of the tensor whose c10::TensorImpl is at `impl`, nullptr
// when lazy_reads declines it (type not learned, not an XLATensorImpl, a
// functional wrapper awaiting a sync).  `functional`: read through a
// FunctionalTensorWrapper.  Independent of SetLazyReadsEnabled.
torch::lazy::LazyTensor* XlaLazyTensorOf(uintptr_t impl, bool* functional);

// Points the XLA tensor `carrier` at `buffer` (its torch LazyTensor::Data
// handle, keeping its own aside) until RestoreCarrier: a buffer no tensor
// holds (a dead step input, a donor released before a step that failed)
// then takes torch_xla's `_set_buffer_donation(carrier, flag)`, which reads
// only the handle.  Python makes that call in between (docs/design.md, "A
// carrier tensor").  False, nothing changed, when `carrier` is no readable
// XLA tensor, `buffer` is empty or the carrier points already.
bool PointCarrier(PyObject* carrier, const torch::lazy::BackendDataPtr& buffer);

// The `xla::device_data` op symbol (what a tensor's cached IR is when it
// reads a buffer).
const c10::Symbol& DeviceDataOp();

// A demangled C++ type name (RTTI guards).
std::string Demangled(const char* mangled);

}  // namespace torch_xla_donate
