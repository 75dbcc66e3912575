// For the files that read torch's lazy-tensor types themselves: heavy includes, kept from others.
#pragma once

#include <ATen/core/symbol.h>
#include <torch/csrc/lazy/backend/backend_data.h>
#include <torch/csrc/lazy/core/tensor.h>

#include "reads.h"

namespace torch_xla_donate {

// The LazyTensor of the XLA tensor at `impl`: null when the layout guard declines it.
torch::lazy::LazyTensor* XlaLazyTensorOf(uintptr_t impl, bool* functional);
bool PointCarrier(PyObject* carrier, const torch::lazy::BackendDataPtr& buffer);
const c10::Symbol& DeviceDataOp();        // `xla::device_data`
std::string Demangled(const char* name);  // for the RTTI guards

}  // namespace torch_xla_donate
