// See poison.h.
#include "outcomes/poison.h"

#include <pybind11/pybind11.h>

#include <unordered_map>

#include "base/py_types.h"
#include "base/tensor_access.h"
#include "base/tensor_facts.h"
#include "base/variable.h"
#include "outcomes/donated_key.h"
#include "outcomes/record_tag.h"

namespace torch_xla_donate {
namespace {

// Each class and its poisoned twins (poison.py's _poison_class_for): the one
// the user's tensor takes, and the one refusing operators, which the tensor
// torch_xla computes with takes.  `checked`: a swap from the class to the
// twin went through Python's own `__class__` assignment once, which checks
// that their layouts agree; the twin is the class's subclass with nothing
// added, so later swaps need only what that assignment does after its check.
struct Twin {
  PyObject* cls;
  bool checked;
};
std::unordered_map<PyTypeObject*, Twin> g_poison_classes[2];

// The poisoned twin of `type` (cached).  Borrowed, or nullptr with an error.
Twin* PoisonClassFor(PyTypeObject* type, bool refuses_operators) {
  auto& cache = g_poison_classes[refuses_operators ? 1 : 0];
  auto it = cache.find(type);
  if (it != cache.end()) return &it->second;
  PyObject* hook = refuses_operators ? g_hooks.dispatch_class_for : g_hooks.poison_class_for;
  PyObject* twin = PyObject_CallOneArg(hook, reinterpret_cast<PyObject*>(type));
  if (!twin) return nullptr;
  Py_INCREF(type);  // keep the key alive: its address must not be reused
  return &cache.emplace(type, Twin{twin, false}).first->second;
}

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
int SwapClass(PyObject* t, Twin* twin) {
  PyTypeObject* from = Py_TYPE(t);
  auto* to = reinterpret_cast<PyTypeObject*>(twin->cls);
  const bool managed = (from->tp_flags | to->tp_flags) & Py_TPFLAGS_MANAGED_DICT;
  if (!twin->checked || (managed && _PyObject_GetDictPtr(t) == nullptr)) {
    if (PyObject_GenericSetAttr(t, ClassAttr(), twin->cls) < 0) return -1;
    twin->checked = true;
    return 0;
  }
  if (PySys_Audit("object.__setattr__", "OsO", t, "__class__", twin->cls) < 0) return -1;
  if (to->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_INCREF(to);
  Py_SET_TYPE(t, to);
  if (from->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_DECREF(from);
  return 0;
}

// Gives `t` its poisoned twin class (none if it has one).  0 ok, -1 error.
int TakeTwinClass(PyObject* t, bool refuses_operators) {
  if (IsDonatedType(t)) return 0;
  Twin* twin = PoisonClassFor(Py_TYPE(t), refuses_operators);
  return twin ? SwapClass(t, twin) : -1;
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

void ForgetPoisonClasses() {
  for (auto& cache : g_poison_classes) {
    for (auto& kv : cache) {
      Py_DECREF(kv.second.cls);
      Py_DECREF(reinterpret_cast<PyObject*>(kv.first));
    }
    cache.clear();
  }
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

int Poison(PyObject* t, const RecordPtr& r, PyObject** keep_inner) {
  // The tensor torch_xla computes with: for a functional tensor (torch_xla's
  // default) the one it wraps, which every operator on `t` reaches after
  // functionalization unwrapped it; else `t` itself.
  // That one first: once it refuses operators the value is safe, whatever
  // happens to the wrapper the user holds.
  // (poison.py's `inner`, without its Python frame: the Functionalize key
  // read in place, torch's builtin called only for a functional tensor.)
  const uintptr_t impl = ImplAddress(t);
  if (impl == 0) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.Tensor");
    return -1;
  }
  const bool functional = IsFunctionalImpl(impl);
  if (DonatedKeyInUse()) {
    // The donated key on the TensorImpl torch_xla computes with
    // (donated_key.h): no Python object for it, nothing for an entry to keep.
    const uintptr_t core = functional ? FunctionalInnerImpl(t) : impl;
    if (core == 0 || !TagRecord(core, r)) {
      PyErr_SetString(PyExc_TypeError, "cannot tag this tensor with its donation record");
      return -1;
    }
    SetDonatedKey(core, true);
    return TakeTwinClass(t, /*refuses_operators=*/false);
  }
  PyObject* inner = t;
  if (functional) {
    inner = FunctionalInnerObject(t);  // torch's own wrap, without the builtin's parser
    if (!inner && PyErr_Occurred()) return -1;
    if (!inner) inner = PyObject_CallOneArg(g_hooks.from_functional, t);
    if (!inner) return -1;
  } else {
    Py_INCREF(inner);
  }
  int rc = TagTensor(inner, r);
  if (rc == 0) rc = TakeTwinClass(inner, /*refuses_operators=*/true);
  const uintptr_t core = rc == 0 ? ImplAddress(inner) : 0;
  if (rc == 0 && core == 0) rc = -1;
  if (rc == 0 && !SetPythonDispatch(core, true)) {
    PyErr_SetString(PyExc_RuntimeError, "cannot set the Python dispatch key of a donated tensor");
    rc = -1;
  }
  // The wrapper takes its twin class only: the record rides on the tensor
  // torch_xla computes with, where poison.py's donation_record reads it.
  if (rc == 0 && inner != t) rc = TakeTwinClass(t, /*refuses_operators=*/false);
  if (rc == 0 && inner != t && keep_inner != nullptr) {
    *keep_inner = inner;  // the caller's reference now
    return 0;
  }
  Py_DECREF(inner);
  return rc;
}

}  // namespace torch_xla_donate
