// See poison.h.
#include "outcomes/poison.h"

#include <pybind11/pybind11.h>

#include <unordered_map>
#include <unordered_set>

#include "base/py_types.h"
#include "base/tensor_access.h"
#include "base/tensor_facts.h"
#include "base/variable.h"
#include "marking/marking.h"
#include "outcomes/donated_key.h"
#include "outcomes/record_tag.h"

namespace torch_xla_donate {
namespace {

// Each twin class (marking.h TwinClassOf) whose swap from its class went
// through Python's own `__class__` assignment once, which checks that their
// layouts agree; the twin is the class's subclass with nothing added, so
// later swaps need only what that assignment does after its check.
std::unordered_set<PyObject*> g_checked;

PyObject* ClassAttr() {
  static PyObject* name = PyUnicode_InternFromString("__class__");
  return name;
}

// `t.__class__ = twin`.  The first time per class: generic, past a
// __setattr__ of the tensor's own class (poison.py's _set_class does the
// same), with all of Python's checks.  Then what object_set_class does once
// they passed: the audit event, the instance's attributes moved into a dict
// of their own (a managed dict's keys belong to the class:
// _PyObject_GetDictPtr does it, as object_set_class does), the type
// swapped, heap types' references moved.
int SwapClass(PyObject* t, PyObject* twin) {
  PyTypeObject* from = Py_TYPE(t);
  auto* to = reinterpret_cast<PyTypeObject*>(twin);
  const bool managed = (from->tp_flags | to->tp_flags) & Py_TPFLAGS_MANAGED_DICT;
  if (!g_checked.count(twin) || (managed && _PyObject_GetDictPtr(t) == nullptr)) {
    if (PyObject_GenericSetAttr(t, ClassAttr(), twin) < 0) return -1;
    g_checked.insert(twin);
    return 0;
  }
  if (PySys_Audit("object.__setattr__", "OsO", t, "__class__", twin) < 0) return -1;
  if (to->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_INCREF(to);
  Py_SET_TYPE(t, to);
  if (from->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_DECREF(from);
  return 0;
}

// Gives `t` its poisoned twin class (none if it has one).  0 ok, -1 error.
int TakeTwinClass(PyObject* t) {
  if (IsDonatedType(t)) return 0;
  PyObject* twin = TwinClassOf(Py_TYPE(t));
  if (twin == nullptr) {
    PyErr_Format(PyExc_TypeError, "no poisoned twin of %s was registered", Py_TYPE(t)->tp_name);
    return -1;
  }
  return SwapClass(t, twin);
}

// A poisoned tensor's Python object is about to die (its finalizer: torch's
// deallocation of a tensor subclass calls it once it has made sure that
// object is the TensorImpl's last owner, and clears it right after): an
// entry's weak reference to that TensorImpl goes now
// (py_types.h WeakenedTensorDying), so that the TensorImpl, the tensor it
// wraps and torch_xla's tensor die with the object, as a plain tensor's do,
// rather than at the next barrier.
void TwinFinalize(PyObject* self) {
  const uintptr_t impl = ImplAddress(self);
  if (impl != 0) WeakenedTensorDying(impl);
}

// The finalizers the twins of classes with a `__del__` inherited, by twin.
std::unordered_map<PyTypeObject*, destructor> g_inherited_finalizers;

// TwinFinalize after the user's own finalizer.  One that keeps the tensor
// alive (stores it somewhere) leaves it without the entry's weak
// reference: its verdict then reaches it only through a use, as a tensor
// its entry let go of.
void TwinFinalizeAfterTheUsers(PyObject* self) {
  auto it = g_inherited_finalizers.find(Py_TYPE(self));
  if (it != g_inherited_finalizers.end()) it->second(self);
  TwinFinalize(self);
}

}  // namespace

bool WatchDeaths(PyObject* cls) {
  if (!PyType_Check(cls)) return false;
  auto* type = reinterpret_cast<PyTypeObject*>(cls);
  if (type->tp_finalize == TwinFinalize || type->tp_finalize == TwinFinalizeAfterTheUsers)
    return true;
  // Not tp_dealloc: `__class__` assignment requires a twin's to be its
  // base's.  A finalizer it does not look at.
  if (type->tp_finalize != nullptr) {  // the user's class has a __del__
    Py_INCREF(cls);                    // the key's address must not be reused
    g_inherited_finalizers.emplace(type, type->tp_finalize);
    type->tp_finalize = TwinFinalizeAfterTheUsers;
    return true;
  }
  type->tp_finalize = TwinFinalize;
  return true;
}

int TagTensor(PyObject* t, const RecordPtr& record, const std::string& note) {
  const uintptr_t impl = ImplAddress(t);
  if (impl == 0) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.Tensor");
    return -1;
  }
  if (!TagRecord(impl, record, note)) {
    PyErr_SetString(PyExc_TypeError, "cannot tag this tensor with its donation record");
    return -1;
  }
  return 0;
}

namespace {
// The TensorImpl torch_xla computes with behind `t` (the one a functional
// tensor wraps), or 0 with a Python error.
uintptr_t CoreOf(PyObject* t) {
  const uintptr_t impl = ImplAddress(t);
  if (impl == 0) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.Tensor");
    return 0;
  }
  const uintptr_t core = IsFunctionalImpl(impl) ? FunctionalInnerImpl(t) : impl;
  if (core == 0) PyErr_SetString(PyExc_TypeError, "cannot read this tensor's TensorImpl");
  return core;
}
}  // namespace

int Poison(PyObject* t, const RecordPtr& r, const std::string& note) {
  // The tensor torch_xla computes with: for a functional tensor (torch_xla's
  // default) the one it wraps, which every operator on `t` reaches after
  // functionalization unwrapped it; else `t` itself.  That one first: once
  // it refuses operators the value is safe, whatever happens to the wrapper
  // the user holds.  It takes the donated key (donated_key.h): no Python
  // object is made for it.
  if (!DonatedKeyInUse()) {
    PyErr_SetString(PyExc_RuntimeError, "poisoning's dispatch key is off");
    return -1;
  }
  const uintptr_t core = CoreOf(t);
  if (core == 0) return -1;
  if (!TagRecord(core, r, note)) {
    PyErr_SetString(PyExc_TypeError, "cannot tag this tensor with its donation record");
    return -1;
  }
  SetDonatedKey(core, true);
  return TakeTwinClass(t);
}

int Unpoison(PyObject* t) {
  const uintptr_t core = CoreOf(t);
  if (core == 0) return -1;
  SetDonatedKey(core, false);
  UntagRecord(core);
  if (!IsDonatedType(t)) return 0;
  // The twin's only base besides the mixin is the class it was made for.
  PyObject* bases = Py_TYPE(t)->tp_bases;
  PyObject* original = PyTuple_GET_ITEM(bases, PyTuple_GET_SIZE(bases) - 1);
  if (TwinClassOf(reinterpret_cast<PyTypeObject*>(original)) !=
      reinterpret_cast<PyObject*>(Py_TYPE(t))) {
    PyErr_SetString(PyExc_TypeError, "a donated class torch_xla_donate did not make");
    return -1;
  }
  return PyObject_GenericSetAttr(t, ClassAttr(), original);
}

}  // namespace torch_xla_donate
