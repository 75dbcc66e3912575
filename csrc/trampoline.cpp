// `_C.Trampoline(real, before, after)` stands in for an `_XLAC` function, calling `real` from C so
// that PT_XLA_DEBUG sees the user's frame (docs/design.md):
//   token = before(*args, **kwargs)      # raising: real is not called
//   if token is PASS: return real(*args, **kwargs)
//   result = real(*args, **kwargs)       # error: after(token, None, error), then it propagates
//   return after(token, result, None)
#include "common.h"

namespace torch_xla_donate {
namespace {

struct PyTrampoline {
  PyObject_HEAD PyObject* real;
  PyObject* before;
  PyObject* after;
};

PyObject* g_pass = nullptr;  // the sentinel token "not ours: call real alone"

int TrampolineInit(PyObject* self, PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {"real", "before", "after", nullptr};
  PyObject *real, *before, *after;
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO:Trampoline", const_cast<char**>(kNames),
                                   &real, &before, &after))
    return -1;
  if (!PyCallable_Check(real) || !PyCallable_Check(before) || !PyCallable_Check(after)) {
    PyErr_SetString(PyExc_TypeError, "Trampoline(real, before, after) takes three callables");
    return -1;
  }
  auto* t = reinterpret_cast<PyTrampoline*>(self);
  Py_XSETREF(t->real, Py_NewRef(real));
  Py_XSETREF(t->before, Py_NewRef(before));
  Py_XSETREF(t->after, Py_NewRef(after));
  return 0;
}

int TrampolineTraverse(PyObject* self, visitproc visit, void* arg) {
  auto* t = reinterpret_cast<PyTrampoline*>(self);
  Py_VISIT(t->real);
  Py_VISIT(t->before);
  Py_VISIT(t->after);
  Py_VISIT(Py_TYPE(self));
  return 0;
}

int TrampolineClear(PyObject* self) {
  auto* t = reinterpret_cast<PyTrampoline*>(self);
  Py_CLEAR(t->real);
  Py_CLEAR(t->before);
  Py_CLEAR(t->after);
  return 0;
}

void TrampolineDealloc(PyObject* self) {
  PyObject_GC_UnTrack(self);
  TrampolineClear(self);
  FreeInstance(self);
}

PyObject* TrampolineCall(PyObject* self, PyObject* args, PyObject* kwargs) {
  auto* t = reinterpret_cast<PyTrampoline*>(self);
  if (!t->real) {
    PyErr_SetString(PyExc_RuntimeError, "uninitialized Trampoline");
    return nullptr;
  }
  PyObject* token = PyObject_Call(t->before, args, kwargs);
  if (!token) return nullptr;
  if (token == g_pass) {
    Py_DECREF(token);
    return PyObject_Call(t->real, args, kwargs);
  }
  PyObject* result = PyObject_Call(t->real, args, kwargs);
  if (!result) {
    // To `after`, then on (unless `after` raises its own, which carries this one as context).
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (traceback) PyException_SetTraceback(value, traceback);
    PyObject* call_args[3] = {token, Py_None, value ? value : Py_None};
    PyObject* done = PyObject_Vectorcall(t->after, call_args, 3, nullptr);
    Py_DECREF(token);
    if (!done) {
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(traceback);
      return nullptr;
    }
    Py_DECREF(done);
    PyErr_Restore(type, value, traceback);
    return nullptr;
  }
  PyObject* call_args[3] = {token, result, Py_None};
  PyObject* out = PyObject_Vectorcall(t->after, call_args, 3, nullptr);
  Py_DECREF(token);
  Py_DECREF(result);
  return out;
}

PyObject* GetReal(PyObject* self, void*) {
  PyObject* real = reinterpret_cast<PyTrampoline*>(self)->real;
  return Py_NewRef(real ? real : Py_None);
}

// As a class attribute it binds like a function: `obj.method(...)` calls real(obj, ...).
PyObject* TrampolineGet(PyObject* self, PyObject* obj, PyObject*) {
  return obj == nullptr || obj == Py_None ? Py_NewRef(self) : PyMethod_New(self, obj);
}

PyGetSetDef kGetters[] = {
    {"real", GetReal, nullptr, "The function this stands in for.", nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kSlots[] = {
    {Py_tp_init, reinterpret_cast<void*>(TrampolineInit)},
    {Py_tp_new, reinterpret_cast<void*>(PyType_GenericNew)},
    {Py_tp_call, reinterpret_cast<void*>(TrampolineCall)},
    {Py_tp_dealloc, reinterpret_cast<void*>(TrampolineDealloc)},
    {Py_tp_traverse, reinterpret_cast<void*>(TrampolineTraverse)},
    {Py_tp_clear, reinterpret_cast<void*>(TrampolineClear)},
    {Py_tp_getset, kGetters},
    {Py_tp_descr_get, reinterpret_cast<void*>(TrampolineGet)},
    {Py_tp_doc,
     const_cast<char*>("Trampoline(real, before, after): calls real(*args) from C between "
                       "before(*args) and after(token, result, error).")},
    {0, nullptr},
};

}  // namespace

void RegisterTrampoline(py::module_& m) {
  m.attr("Trampoline") = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(
      NewType("torch_xla_donate._C.Trampoline", sizeof(PyTrampoline), kSlots,
              Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE)));
  py::object sentinel = py::module_::import("builtins").attr("object")();
  g_pass = sentinel.inc_ref().ptr();  // kept for the life of the process
  m.attr("PASS") = sentinel;
}

}  // namespace torch_xla_donate
