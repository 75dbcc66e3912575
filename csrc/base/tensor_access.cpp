// See tensor_access.h.
#include "base/tensor_access.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <unordered_map>

#include "base/py_types.h"
#include "base/variable.h"

namespace py = pybind11;

namespace torch_xla_donate {

Hooks g_hooks;

void Check(bool ok) {
  if (!ok) throw py::error_already_set();
}

void RequireBound() {
  if (!g_hooks.torch_bound() || !g_hooks.poison_bound())
    throw std::runtime_error("torch_xla_donate._C: hooks are not bound (import torch_xla_donate)");
}

bool IsTensor(PyObject* t) {
  return PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g_hooks.tensor_type));
}

bool IsDonatedType(PyObject* t) {
  return g_hooks.donated_type &&
         PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g_hooks.donated_type));
}

uintptr_t ImplAddress(PyObject* t) { return IsTensor(t) ? VariableImplAddress(t) : 0; }

int Facts(PyObject* t, TensorFacts* facts, bool with_sizes) {
  const uintptr_t impl = ImplAddress(t);
  return impl != 0 && ReadTensorFacts(impl, facts, with_sizes) ? 1 : 0;
}

int HeldByAutograd(PyObject* t, const TensorFacts& facts) {
  if (facts.impl_use_count <= 1) return 0;
  return facts.impl_use_count > 1 + (AccumulatesGrad(t) ? 1 : 0) ? 1 : 0;
}

bool ReadLazy(PyObject* t, LazyFacts* facts) {
  if (!LazyReadsEnabled()) return false;
  const uintptr_t impl = ImplAddress(t);
  return impl != 0 && ReadLazyFacts(impl, facts);
}

int HasPendingIr(PyObject* t) {
  LazyFacts facts;
  // A tensor the reader declines is no plain device data: pending.
  return !ReadLazy(t, &facts) || facts.pending ? 1 : 0;
}

void PrefetchTensors(PyObject* const* items, Py_ssize_t n) {
  if (!LazyReadsEnabled()) return;
  for (Py_ssize_t first = 0; first < n; first += kPrefetchGroup) {
    const size_t group = std::min<size_t>(kPrefetchGroup, n - first);
    uintptr_t impls[kPrefetchGroup];
    for (size_t i = 0; i < group; ++i) __builtin_prefetch(items[first + i]);
    for (size_t i = 0; i < group; ++i) impls[i] = ImplAddress(items[first + i]);
    PrefetchLazy(impls, group);
    for (size_t i = 0; i < group; ++i)
      if (impls[i]) PrefetchTensorFacts(impls[i]);
  }
}

bool PendingFlags(PyObject* list, std::vector<char>* out) {
  const Py_ssize_t n = PyList_GET_SIZE(list);
  PrefetchTensors(PySequence_Fast_ITEMS(list), n);
  out->assign(n, 0);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(list, i);
    TensorFacts facts;
    if (Facts(t, &facts, /*with_sizes=*/false) != 1 || !facts.is_xla) {
      PyErr_Format(PyExc_TypeError, "pending_flags() takes XLA tensors, got a %s",
                   Py_TYPE(t)->tp_name);
      return false;
    }
    (*out)[i] = HasPendingIr(t);
  }
  return true;
}

int BufferDeleted(PyObject* t) {
  LazyFacts facts;
  if (ReadLazy(t, &facts)) return facts.consumed() ? 1 : 0;
  PyErr_SetString(PyExc_TypeError, "torch_xla_donate cannot read this tensor's device buffer");
  return -1;
}

int OnlyHeldByItsEntry(PyObject* t) {
  if (Py_REFCNT(t) != 1) return 0;
#if PY_VERSION_HEX < 0x030C0000
  if (Py_TYPE(t)->tp_weaklistoffset > 0 && *PyObject_GET_WEAKREFS_LISTPTR(t) != nullptr) return 0;
#else
  return 0;  // weak references are managed by the interpreter: assume some
#endif
  TensorFacts facts;
  int read = Facts(t, &facts, /*with_sizes=*/false);
  if (read < 0) return -1;
  return read == 1 && facts.impl_use_count == 1 ? 1 : 0;
}

}  // namespace torch_xla_donate
