// See ownership.h.
#include "outcomes/ownership.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <vector>

#include "base/tensor_access.h"
#include "base/tensor_facts.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

// live_objects(types) -> one list per type: the objects the garbage
// collector tracks that are instances of it, except the Python objects of
// tensors (the first type) that only their TensorImpl keeps alive.
//
// Why: the collector also hands out the Python object of a tensor whose
// last Python reference is gone while C++ (an autograd graph) still holds
// the tensor; torch then lets the TensorImpl own that object.  No Python
// code holds such an object, so as a holder it is C++'s (ownership.py
// counts it as such), and kept in a list it would outlive its TensorImpl
// when autograd's worker thread lets the graph go (torch: "Deallocating
// Tensor that still has live PyObject references").  The walk and the
// filter run in one native call, without giving up the GIL, so no other
// thread can let go of a tensor in between.
py::tuple LiveObjects(py::tuple types) {
  static PyObject* get_objects = [] {
    PyObject* gc = PyImport_ImportModule("gc");
    Check(gc != nullptr);
    PyObject* fn = PyObject_GetAttrString(gc, "get_objects");
    Py_DECREF(gc);
    Check(fn != nullptr);
    return fn;
  }();
  const Py_ssize_t n = PyTuple_GET_SIZE(types.ptr());
  for (Py_ssize_t k = 0; k < n; ++k)
    if (!PyType_Check(PyTuple_GET_ITEM(types.ptr(), k)))
      throw py::type_error("live_objects() takes types");
  py::object objects = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(get_objects));
  Check(objects.ptr() != nullptr);
  std::vector<py::list> found(n);
  for (Py_ssize_t i = 0, m = PyList_GET_SIZE(objects.ptr()); i < m; ++i) {
    PyObject* o = PyList_GET_ITEM(objects.ptr(), i);
    for (Py_ssize_t k = 0; k < n; ++k) {
      auto* type = reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(types.ptr(), k));
      if (!PyObject_TypeCheck(o, type)) continue;
      if (k == 0) {
        const uintptr_t impl = ImplAddress(o);
        if (impl == 0 || PyObjectOwnedByTensor(impl)) break;  // undefined, or C++'s
      }
      Check(PyList_Append(found[k].ptr(), o) == 0);
      break;
    }
  }
  py::tuple out(n);
  for (Py_ssize_t k = 0; k < n; ++k) out[k] = found[k];
  return out;
}

}  // namespace

void RegisterOwnership(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  m.def("live_objects", &LiveObjects, py::arg("types"),
        "One list per type of the objects the garbage collector tracks, without the "
        "tensors (the first type) whose Python object only C++ keeps alive.");
}

}  // namespace torch_xla_donate
