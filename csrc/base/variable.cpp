// See variable.h.  The only file that includes torch's Python binding
// header (torch/csrc/autograd/python_variable.h, shipped in the torch
// wheel): the layout of a tensor's Python object comes from the torch this
// extension is built against, which the import checks it runs with.  Only
// inline code of that header is used; nothing links libtorch_python: its
// THPVariable_Wrap is looked up in the copy torch loaded (torch is imported
// before any tensor reaches this file), typed by the header's declaration.
#include "base/variable.h"

#include <ATen/FunctionalTensorWrapper.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/python_variable.h>

#include <atomic>
#include <type_traits>

namespace torch_xla_donate {

uintptr_t VariableImplAddress(PyObject* t) {
  return reinterpret_cast<uintptr_t>(THPVariable_Unpack(t).unsafeGetTensorImpl());
}

namespace {

// THPVariable_Wrap's type, from the header's declaration (the same in torch
// 2.7-2.9), and its symbol there.
using WrapFn = PyObject* (*)(const at::TensorBase&);
static_assert(std::is_same_v<WrapFn, decltype(&THPVariable_Wrap)>, "THPVariable_Wrap changed");
constexpr const char* kWrapSymbol = "_Z16THPVariable_WrapRKN2at10TensorBaseE";

// torch's THPVariable_Wrap, or nullptr when it cannot be found.
WrapFn TorchWrap() {
  static const WrapFn wrap = []() -> WrapFn {
    void* lib = dlopen("libtorch_python.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    void* symbol = dlsym(lib, kWrapSymbol);
    dlclose(lib);  // only drops the reference RTLD_NOLOAD added: torch keeps it loaded
    return reinterpret_cast<WrapFn>(symbol);
  }();
  return wrap;
}

c10::TensorImpl* ImplAt(uintptr_t impl) { return reinterpret_cast<c10::TensorImpl*>(impl); }

}  // namespace

bool IsView(PyObject* t) { return THPVariable_Unpack(t).is_view(); }

bool AccumulatesGrad(PyObject* t) {
  const at::Tensor& v = THPVariable_Unpack(t);
  return v.is_leaf() && v.requires_grad();
}

uintptr_t FunctionalInnerImpl(PyObject* t) {
  const at::Tensor& outer = THPVariable_Unpack(t);
  if (!at::functionalization::impl::isFunctionalTensor(outer)) return 0;
  return reinterpret_cast<uintptr_t>(at::functionalization::impl::unsafeGetFunctionalWrapper(outer)
                                         ->value()
                                         .unsafeGetTensorImpl());
}

bool FunctionalInnerHasObject(PyObject* t) {
  const uintptr_t inner = FunctionalInnerImpl(t);
  return inner != 0 && ImplAt(inner)->pyobj_slot()->_unchecked_untagged_pyobj() != nullptr;
}

PyObject* WrapTensor(const at::TensorBase& t) {
  const WrapFn wrap = TorchWrap();
  if (wrap == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "torch's THPVariable_Wrap was not found");
    return nullptr;
  }
  return wrap(t);
}

uintptr_t WeakTensorTake(PyObject* t) {
  if (TorchWrap() == nullptr) return 0;
  c10::TensorImpl* impl = THPVariable_Unpack(t).unsafeGetTensorImpl();
  c10::raw::weak_intrusive_ptr::incref(impl);
  return reinterpret_cast<uintptr_t>(impl);
}

void WeakTensorDrop(uintptr_t impl) { c10::raw::weak_intrusive_ptr::decref(ImplAt(impl)); }

bool WeakTensorAlive(uintptr_t impl) {
  // A TensorImpl keeps its Python object's address while that object
  // lives (torch clears it when the object dies without being kept).
  return c10::raw::weak_intrusive_ptr::use_count(ImplAt(impl)) > 0 &&
         ImplAt(impl)->pyobj_slot()->_unchecked_untagged_pyobj() != nullptr;
}

PyObject* WeakTensorObject(uintptr_t impl) {
  c10::TensorImpl* locked = c10::raw::weak_intrusive_ptr::lock(ImplAt(impl));
  if (locked == nullptr) return nullptr;
  const at::Tensor tensor(
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(locked));
  if (locked->pyobj_slot()->_unchecked_untagged_pyobj() == nullptr) return nullptr;
  // torch's own wrap: it gives back the object the TensorImpl keeps, and
  // hands it back to Python if C++ owned it meanwhile.
  return TorchWrap()(tensor);
}

}  // namespace torch_xla_donate
