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

// owner_suspects(query, tensors, slice, no_owner, uncloned) -> [(index, owner)]
//
// sharing.py's always-on question, natively: which of `tensors` (no pending
// IR) have a buffer torch_xla files under another tensor's id?  `query` is
// torch_xla's _get_tensors_xla_device_data_node, asked per slice of `slice`
// tensors (its cost per tensor grows with the length of one query).  With
// `uncloned` (torch_xla 2.8+) it hands back the very tensor passed for a
// buffer filed under that tensor's id: an identity test; else the ids are
// compared with each tensor's own.  `no_owner`: a buffer no graph has read.
// A slice whose answer is shorter (tensors sharing one buffer are listed
// once) cannot say which is which: each of its tensors is a suspect with
// owner None.  _base/xla.py owner_suspects is the Python twin.
py::list OwnerSuspects(py::object query, py::list tensors, Py_ssize_t slice, int64_t no_owner,
                       bool uncloned) {
  if (slice < 1) throw py::value_error("slice must be positive");
  if (!uncloned) RequireBound();  // the tensor-id hook
  py::list out;
  const Py_ssize_t n = PyList_GET_SIZE(tensors.ptr());
  for (Py_ssize_t start = 0; start < n; start += slice) {
    const Py_ssize_t len = std::min(slice, n - start);
    py::list part =
        py::reinterpret_steal<py::list>(PyList_GetSlice(tensors.ptr(), start, start + len));
    Check(part.ptr() != nullptr);
    py::object answer = uncloned ? query(part, part) : query(part);
    py::sequence pair = answer.cast<py::sequence>();
    py::list ids = py::list(pair[0]);
    py::list held = uncloned ? py::list(pair[1]) : py::list();
    if (PyList_GET_SIZE(ids.ptr()) != len) {
      for (Py_ssize_t j = 0; j < len; ++j) out.append(py::make_tuple(start + j, py::none()));
      continue;
    }
    for (Py_ssize_t j = 0; j < len; ++j) {
      PyObject* owner = PyList_GET_ITEM(ids.ptr(), j);
      const int64_t id = PyLong_AsLongLong(owner);
      Check(!(id == -1 && PyErr_Occurred()));
      if (id == no_owner) continue;
      PyObject* t = PyList_GET_ITEM(part.ptr(), j);
      bool own;
      if (uncloned) {
        own = PyList_GET_ITEM(held.ptr(), j) == t;
      } else {
        const int64_t mine = TensorId(t);
        Check(!(mine == -1 && PyErr_Occurred()));
        own = id == mine;
      }
      if (!own) out.append(py::make_tuple(start + j, py::handle(owner)));
    }
  }
  return out;
}

}  // namespace

void RegisterOwnership(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  m.def("live_objects", &LiveObjects, py::arg("types"),
        "One list per type of the objects the garbage collector tracks, without the "
        "tensors (the first type) whose Python object only C++ keeps alive.");
  m.def("owner_suspects", &OwnerSuspects, py::arg("query"), py::arg("tensors"), py::arg("slice"),
        py::arg("no_owner"), py::arg("uncloned"),
        "[(index, owner)] of the tensors whose buffer torch_xla files under another "
        "tensor id (owner None: the answer does not say); see _base/xla.py owner_suspects.");
}

}  // namespace torch_xla_donate
