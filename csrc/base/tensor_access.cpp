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

namespace {

struct Names {
  PyObject *is_view, *dtype, *untyped_storage, *cdata, *klass, *is_leaf, *requires_grad;
};

const Names& N() {
  static const Names names = {
      PyUnicode_InternFromString("_is_view"),        PyUnicode_InternFromString("dtype"),
      PyUnicode_InternFromString("untyped_storage"), PyUnicode_InternFromString("_cdata"),
      PyUnicode_InternFromString("__class__"),       PyUnicode_InternFromString("is_leaf"),
      PyUnicode_InternFromString("requires_grad"),
  };
  return names;
}

// 1 / 0 for the truth of `o` (a new reference, consumed), -1 on error.
int Truth(PyObject* o) {
  if (!o) return -1;
  int r = PyObject_IsTrue(o);
  Py_DECREF(o);
  return r;
}

struct DtypeInfo {
  DtypeName name = nullptr;  // interned
  int64_t itemsize = 0;
};
// Keyed by the dtype object (torch dtypes are singletons); the map holds a
// reference to each key so an address is never reused for another dtype.
std::unordered_map<PyObject*, DtypeInfo> g_dtypes;
// The dtype of each c10::ScalarType seen so far, filled from LookupDtype.
const DtypeInfo* g_dtype_by_scalar_type[64] = {};
const DtypeInfo* LookupDtype(PyObject* dtype) {
  auto it = g_dtypes.find(dtype);
  if (it != g_dtypes.end()) return &it->second;
  PyObject* info = PyObject_CallOneArg(g_hooks.dtype_info, dtype);
  if (!info) return nullptr;
  DtypeInfo d;
  PyObject *name = nullptr, *size = nullptr;
  bool ok = PyTuple_Check(info) && PyTuple_GET_SIZE(info) == 2 &&
            PyUnicode_Check(name = PyTuple_GET_ITEM(info, 0)) &&
            PyLong_Check(size = PyTuple_GET_ITEM(info, 1));
  const char* utf8 = ok ? PyUnicode_AsUTF8(name) : nullptr;
  ok = utf8 != nullptr;
  if (ok) {
    d.name = InternDtype(utf8);
    d.itemsize = PyLong_AsLongLong(size);
  }
  Py_DECREF(info);
  if (!ok) {
    PyErr_SetString(PyExc_TypeError, "dtype_info must return (str, int)");
    return nullptr;
  }
  Py_INCREF(dtype);
  return &g_dtypes.emplace(dtype, std::move(d)).first->second;
}

}  // namespace

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

// Only plain tensors and parameters take the fast path: every other class
// (a user subclass, a wrapper subclass with __torch_dispatch__, a poisoned
// tensor) has its own checks in _marking/checks.py.
bool IsPlainTensor(PyObject* t) {
  if (!g_hooks.fast_types) return IsTensor(t) && !IsDonatedType(t);
  PyObject* types = g_hooks.fast_types;
  for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(types); i < n; ++i)
    if (reinterpret_cast<PyObject*>(Py_TYPE(t)) == PyTuple_GET_ITEM(types, i)) return true;
  return false;
}

uintptr_t ImplAddress(PyObject* t) { return IsTensor(t) ? VariableImplAddress(t) : 0; }

int Facts(PyObject* t, TensorFacts* facts, bool with_sizes) {
  const uintptr_t impl = ImplAddress(t);
  return impl != 0 && ReadTensorFacts(impl, facts, with_sizes) ? 1 : 0;
}

long StorageUseCount(PyObject* t, int read, const TensorFacts& facts) {
  if (read == 1 && facts.storage_use_count > 0) return facts.storage_use_count;
  // torch._C._storage_Use_Count(t.untyped_storage()._cdata), as _base/xla.py
  // storage_use_count, for what tensor_facts cannot read.
  PyObject* storage = PyObject_CallMethodNoArgs(t, N().untyped_storage);
  if (!storage) return -1;
  PyObject* cdata = PyObject_GetAttr(storage, N().cdata);
  Py_DECREF(storage);
  if (!cdata) return -1;
  PyObject* n = PyObject_CallOneArg(g_hooks.storage_use_count, cdata);
  Py_DECREF(cdata);
  if (!n) return -1;
  long count = PyLong_AsLong(n);
  Py_DECREF(n);
  return count;
}

int HeldByAutograd(PyObject* t, const TensorFacts& facts) {
  if (facts.impl_use_count <= 1) return 0;
  int leaf = Truth(PyObject_GetAttr(t, N().is_leaf));
  if (leaf < 0) return -1;
  int grad = leaf ? Truth(PyObject_GetAttr(t, N().requires_grad)) : 0;
  if (grad < 0) return -1;
  return facts.impl_use_count > 1 + (leaf && grad) ? 1 : 0;
}

int IsView(PyObject* t) { return Truth(PyObject_CallMethodNoArgs(t, N().is_view)); }

bool ReadLazy(PyObject* t, LazyFacts* facts) {
  if (!LazyReadsEnabled()) return false;
  const uintptr_t impl = ImplAddress(t);
  return impl != 0 && ReadLazyFacts(impl, facts);
}

namespace {

// The bound need_materialization's answers for `list`, appended to `out`.
bool AskPending(PyObject* list, std::vector<char>* out) {
  PyObject* flags = PyObject_CallOneArg(g_hooks.need_materialization, list);
  if (!flags) return false;
  PyObject* seq = PySequence_Fast(flags, "need_materialization must return a sequence");
  Py_DECREF(flags);
  if (!seq) return false;
  bool ok = PySequence_Fast_GET_SIZE(seq) == PyList_GET_SIZE(list);
  if (!ok) PyErr_SetString(PyExc_ValueError, "need_materialization: a list of another length");
  for (Py_ssize_t i = 0, n = PySequence_Fast_GET_SIZE(seq); ok && i < n; ++i) {
    const int r = PyObject_IsTrue(PySequence_Fast_GET_ITEM(seq, i));
    ok = r >= 0;
    out->push_back(r > 0 ? 1 : 0);
  }
  Py_DECREF(seq);
  return ok;
}

}  // namespace

int HasPendingIr(PyObject* t) {
  LazyFacts facts;
  if (ReadLazy(t, &facts)) return facts.pending ? 1 : 0;
  PyObject* list = PyList_New(1);
  if (!list) return -1;
  Py_INCREF(t);
  PyList_SET_ITEM(list, 0, t);
  std::vector<char> flags;
  const bool ok = AskPending(list, &flags);
  Py_DECREF(list);
  return ok ? flags[0] : -1;
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
  std::vector<Py_ssize_t> asked;  // where the reads declined
  for (Py_ssize_t i = 0; i < n; ++i) {
    LazyFacts facts;
    if (ReadLazy(PyList_GET_ITEM(list, i), &facts))
      (*out)[i] = facts.pending ? 1 : 0;
    else
      asked.push_back(i);
  }
  if (asked.empty()) return true;
  PyObject* probe = PyList_New(static_cast<Py_ssize_t>(asked.size()));
  if (!probe) return false;
  for (size_t k = 0; k < asked.size(); ++k) {
    PyObject* t = PyList_GET_ITEM(list, asked[k]);
    Py_INCREF(t);
    PyList_SET_ITEM(probe, static_cast<Py_ssize_t>(k), t);
  }
  std::vector<char> flags;
  const bool ok = AskPending(probe, &flags);
  Py_DECREF(probe);
  if (!ok) return false;
  for (size_t k = 0; k < asked.size(); ++k) (*out)[asked[k]] = flags[k];
  return true;
}

int BufferDeleted(PyObject* t) {
  LazyFacts facts;
  if (ReadLazy(t, &facts)) return facts.consumed() ? 1 : 0;
  return Truth(PyObject_CallOneArg(g_hooks.buffer_deleted, t));
}

int64_t TensorId(PyObject* t) {
  LazyFacts facts;
  if (ReadLazy(t, &facts)) return facts.tensor_id;
  PyObject* id = PyObject_CallOneArg(g_hooks.tensor_id, t);
  if (!id) return -1;
  int64_t value = PyLong_AsLongLong(id);
  Py_DECREF(id);
  return value;
}

int SetDonor(PyObject* t, bool donate) {
  PyObject* args[2] = {t, donate ? Py_True : Py_False};
  return Truth(PyObject_Vectorcall(g_hooks.set_donor, args, 2, nullptr));
}

int Describe(PyObject* t, TensorFacts& facts, Dims* shape, DtypeName* dtype, int64_t* nbytes) {
  if (facts.symbolic_sizes) return 0;
  int64_t numel = 1;
  for (int64_t d : facts.sizes) numel *= d;
  const int st = facts.scalar_type;
  const bool cacheable = st >= 0 && st < 64;
  const DtypeInfo* info = cacheable ? g_dtype_by_scalar_type[st] : nullptr;
  if (!info) {  // first tensor of this dtype: ask Python once
    PyObject* dt = PyObject_GetAttr(t, N().dtype);
    if (!dt) return -1;
    info = LookupDtype(dt);
    Py_DECREF(dt);
    if (!info) return -1;
    if (cacheable && info->itemsize == facts.itemsize) g_dtype_by_scalar_type[st] = info;
  }
  *shape = facts.sizes;
  *dtype = info->name;
  *nbytes = numel * info->itemsize;
  return 1;
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
