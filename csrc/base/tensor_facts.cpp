// See tensor_facts.h.  With record_tag.cpp and variable.cpp, the only
// files that include torch headers; all are compiled with torch's include
// path and ABI flag and linked to libc10.
#include "base/tensor_facts.h"

#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>

#include <exception>

namespace torch_xla_donate {

bool ReadTensorFacts(uintptr_t address, TensorFacts* out, bool with_sizes) {
  auto* impl = reinterpret_cast<c10::TensorImpl*>(address);
  try {
    // Not impl->is_xla(): for XLA's FunctionalTensorWrapper that asks the
    // wrapped tensor for its device, a virtual call into torch_xla and two
    // more objects to touch.  The dispatch keys, a field of the wrapper,
    // say the same.
    out->is_xla = impl->key_set().has_backend(c10::BackendComponent::XLABit);
    out->is_functional = IsFunctionalImpl(address);
    const c10::Storage& storage = impl->unsafe_storage();  // no throw for storage-less
    out->storage_use_count = storage ? static_cast<long>(storage.use_count()) : 0;
    out->impl_use_count = static_cast<long>(c10::raw::intrusive_ptr::use_count(impl));
    out->has_autograd_meta = impl->autograd_meta() != nullptr;
    // Not const: torch 2.7's TypeMeta::toScalarType() is a non-const method.
    caffe2::TypeMeta dtype = impl->dtype();
    out->itemsize = static_cast<int64_t>(dtype.itemsize());
    out->scalar_type = dtype.isScalarType() ? static_cast<int>(dtype.toScalarType()) : -1;
    out->symbolic_sizes = impl->has_symbolic_sizes_strides();
    out->version =
        impl->is_inference() ? -1 : static_cast<int64_t>(impl->version_counter().current_version());
    out->sizes.clear();
    if (with_sizes && !out->symbolic_sizes) {
      // XLA: its own override, which rebuilds the sizes from torch_xla's
      // shape after every step (about 1.6k instructions).  Not the
      // functional wrapper's own fields instead: `t.resize_(2, 8)` on a
      // [4, 4] tensor leaves them at [4, 4] (test_marking_twins.py,
      // "resized in place, as many elements").
      c10::IntArrayRef sizes = impl->sizes();
      out->sizes.assign(sizes.begin(), sizes.end());
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool HasPythonDispatch(uintptr_t address) {
  return reinterpret_cast<c10::TensorImpl*>(address)->key_set().has(c10::DispatchKey::Python);
}

bool IsFunctionalImpl(uintptr_t address) {
  return reinterpret_cast<c10::TensorImpl*>(address)->key_set().has(
      c10::DispatchKey::Functionalize);
}

uintptr_t StorageAddress(uintptr_t address) {
  auto* impl = reinterpret_cast<c10::TensorImpl*>(address);
  const c10::Storage& storage = impl->unsafe_storage();
  return storage ? reinterpret_cast<uintptr_t>(storage.unsafeGetStorageImpl()) : 0;
}

void PrefetchTensorFacts(uintptr_t address) {
  auto* impl = reinterpret_cast<c10::TensorImpl*>(address);
  const c10::Storage& storage = impl->unsafe_storage();
  if (storage) __builtin_prefetch(storage.unsafeGetStorageImpl());
  // torch's header: a VariableVersion is its counter's intrusive_ptr alone
  // (null for an inference tensor: a prefetch of null is harmless).
  static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion changed");
  __builtin_prefetch(*reinterpret_cast<void* const*>(&impl->version_counter()));
}

bool PyObjectOwnedByTensor(uintptr_t address) {
  auto* impl = reinterpret_cast<c10::TensorImpl*>(address);
  return impl->pyobj_slot()->owns_pyobj();
}

}  // namespace torch_xla_donate
