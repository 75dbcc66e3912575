// See lazy_bindings.h.  Every per-tensor function answers None when native
// reads are off or the read declines (lazy_reads.h): the tensor is no plain
// device data.  The one-tensor reads are bound with
// the CPython API (METH_O), not pybind11, whose dispatch alone would cost
// what the read saves.
#include "lazy/lazy_bindings.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <string>
#include <unordered_map>
#include <vector>

#include "base/py_types.h"
#include "base/tensor_access.h"
#include "hooks/commit.h"
#include "lazy/lazy_reads.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

// The facts of `t` while native reads are on; false: answer None.
bool ReadOn(PyObject* t, LazyFacts* facts) {
  if (!LazyReadsEnabled()) return false;
  const uintptr_t impl = ImplAddress(t);
  return impl != 0 && ReadLazyFacts(impl, facts);
}

PyObject* TensorId(PyObject*, PyObject* t) {
  LazyFacts f;
  if (!ReadOn(t, &f)) Py_RETURN_NONE;
  return PyLong_FromLongLong(f.tensor_id);
}

PyObject* IsPending(PyObject*, PyObject* t) {
  LazyFacts f;
  if (!ReadOn(t, &f)) Py_RETURN_NONE;
  return PyBool_FromLong(f.pending);
}

PyObject* IsConsumed(PyObject*, PyObject* t) {
  LazyFacts f;
  if (!ReadOn(t, &f)) Py_RETURN_NONE;
  return PyBool_FromLong(f.consumed());
}

PyObject* BufferKey(PyObject*, PyObject* t) {
  LazyFacts f;
  if (!ReadOn(t, &f)) Py_RETURN_NONE;
  return PyLong_FromSize_t(f.has_value ? f.buffer : 0);
}

// The fields of lazy_facts' tuple, in order (LAZY_FACT_FIELDS).
constexpr const char* kFields[] = {
    "is_functional",       "tensor_id", "has_handle",       "has_value",        "has_ir",
    "ir_is_device_data",   "pending",   "buffer_use_count", "expected_holders", "owner_tensor_id",
    "xla_tensor_refcount", "buffer",    "handle",
};

py::object FactsTuple(const LazyFacts& f) {
  return py::make_tuple(f.is_functional, f.tensor_id, f.has_handle, f.has_value, f.has_ir,
                        f.ir_is_device_data, f.pending, f.buffer_use_count, f.expected_holders,
                        f.owner_tensor_id, f.xla_tensor_refcount, f.buffer, BufferHandle(f.buffer));
}

// The facts of `t`, read even while native reads are off when `force` (the
// self-test reads before it lets them on).
bool ReadMaybeForced(py::handle t, bool force, LazyFacts* facts) {
  if (!force) return ReadOn(t.ptr(), facts);
  const uintptr_t impl = ImplAddress(t.ptr());
  return impl != 0 && ReadLazyFacts(impl, facts);
}

// (expected, actual, xla_tensor_refcount) of a tensor with a handle; None
// when it has none or the read declines, and without functionalization:
// torch_xla's own views then hold buffers these headers cannot see (a
// tensor once read through a view counts one holder more for good).
py::object Holders(py::handle t, bool force) {
  LazyFacts f;
  if (!ReadMaybeForced(t, force, &f) || !f.has_handle || !f.is_functional) return py::none();
  return py::make_tuple(f.expected_holders, f.buffer_use_count, f.xla_tensor_refcount);
}

// The donors among `tensors` whose buffer, or XLA tensor, has holders
// beyond those the donors sharing it account for (hooks/commit.h
// ExcessHolders, which the commit asks): a list of (index, extra holders),
// [] for none, None when any tensor's holders are unknown (Holders answers
// None).
py::object Excess(py::sequence tensors, bool force) {
  const size_t n = py::len(tensors);
  std::vector<LazyFacts> facts(n);
  for (size_t i = 0; i < n; ++i) {
    if (!ReadMaybeForced(tensors[i], force, &facts[i]) || !facts[i].has_handle ||
        !facts[i].is_functional)
      return py::none();
  }
  const std::vector<long> extra = ExcessHolders(facts);
  py::list over;
  for (size_t i = 0; i < n; ++i)
    if (extra[i] > 0) over.append(py::make_tuple(i, extra[i]));
  return std::move(over);
}

// What torch_xla's owner query (_get_tensors_xla_device_data_node) answers
// for a tensor with a live buffer, without its side effects: it asks for
// the tensor's IR value, and a tensor with a handle but no cached IR value
// gets a new device_data node whose buffer it files under the tensor's own
// id (LazyTensor::CreateTensorNode); otherwise the node's buffer says.
// False: no answer here (no live buffer, or an IR value that is no device
// data next to a handle).
bool QueryOwner(const LazyFacts& f, int64_t* owner) {
  if (!f.has_value) return false;
  if (f.has_handle && !f.has_ir) {
    *owner = f.tensor_id;
    return true;
  }
  if (!f.ir_is_device_data) return false;
  *owner = f.owner_tensor_id;
  return true;
}

PyMethodDef kMethods[] = {
    {"lazy_tensor_id", TensorId, METH_O,
     "lazy_tensor_id(tensor) -> int | None\n\ntorch_xla's id of the XLA tensor behind `tensor` "
     "(as _xla_get_tensor_id); None: declined."},
    {"lazy_is_pending", IsPending, METH_O,
     "lazy_is_pending(tensor) -> bool | None\n\nDoes it need a computation (as "
     "_check_tensor_need_materialization)?  None: declined."},
    {"lazy_is_consumed", IsConsumed, METH_O,
     "lazy_is_consumed(tensor) -> bool | None\n\nA handle without a value (as "
     "_is_placecholder)?  None: declined."},
    {"lazy_buffer_key", BufferKey, METH_O,
     "lazy_buffer_key(tensor) -> int | None\n\nThe address of the live buffer's BackendData "
     "(equal: one buffer; 0: none live: pending, consumed or still computing).  None: "
     "declined."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void RegisterLazyReads(PyObject* module) {
  if (PyModule_AddFunctions(module, kMethods) < 0) throw py::error_already_set();
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  py::tuple fields(std::size(kFields));
  for (size_t i = 0; i < std::size(kFields); ++i) fields[i] = py::str(kFields[i]);
  m.attr("LAZY_FACT_FIELDS") = fields;
  m.def(
      "lazy_facts",
      [](py::handle t, bool force) -> py::object {
        LazyFacts f;
        return ReadMaybeForced(t, force, &f) ? FactsTuple(f) : py::none();
      },
      py::arg("tensor"), py::arg("force") = false,
      "Every fact of lazy_reads.h as a tuple (LAZY_FACT_FIELDS), or None.  `force`: read "
      "even while native reads are off (the self-test).");
  m.def(
      "lazy_holders",
      [](py::iterable tensors, bool force) {
        py::list out;
        for (py::handle t : tensors) out.append(Holders(t, force));
        return out;
      },
      py::arg("tensors"), py::arg("force") = false,
      "For each tensor: (expected, actual, xla_tensor_refcount), the buffer holders a clean "
      "tensor has, those it has, and the owners of its XLATensor (2+: shared by Python "
      "tensors); None without a handle, without functionalization, or when the read "
      "declines.");
  m.def("lazy_excess", &Excess, py::arg("tensors"), py::arg("force") = false,
        "The donors among `tensors` with more buffer holders (or XLATensor owners) than the "
        "donors sharing their buffer account for: [(index, extra)], [] for none; None when "
        "the holders of any are unknown (as lazy_holders).");
  m.def(
      "lazy_owner_ids",
      [](py::iterable tensors, bool force) {
        py::list out;
        for (py::handle t : tensors) {
          LazyFacts f;
          int64_t owner = -1;
          if (ReadMaybeForced(t, force, &f) && QueryOwner(f, &owner))
            out.append(py::int_(owner));
          else
            out.append(py::none());
        }
        return out;
      },
      py::arg("tensors"), py::arg("force") = false,
      "For each tensor: the tensor id torch_xla's owner query files its live buffer under "
      "(-1: none), without the query's side effects; None: no answer here (no live buffer, or "
      "the read declines: lazy_facts tells which).");
  m.def(
      "lazy_learn",
      [](py::handle t) -> std::string {
        const uintptr_t impl = ImplAddress(t.ptr());
        if (impl == 0) return "the sample is no torch.Tensor";
        std::string why;
        return LearnXlaTensorType(impl, &why) ? std::string() : why;
      },
      py::arg("tensor"), "Learns XLATensorImpl's type from a known XLA tensor: '' or why not.");
  m.def(
      "pending_flags",
      [](py::list tensors) {
        std::vector<char> flags;
        Check(PendingFlags(tensors.ptr(), &flags));
        py::list out;
        for (char f : flags) out.append(py::bool_(f != 0));
        return out;
      },
      py::arg("tensors"),
      "Pending computation per XLA tensor (as _check_tensor_need_materialization); a tensor "
      "the reader declines counts as pending (no plain device data).");
  m.def(
      "point_carrier",
      [](py::handle carrier, py::handle entry) {
        return PointCarrierAt(carrier.ptr(), EntryBuffer(entry.ptr()));
      },
      py::arg("carrier"), py::arg("entry"),
      "Points `carrier` at the buffer a released entry keeps (lazy_tensor_of.h PointCarrier); "
      "False, nothing changed, when it keeps none.");
  m.def(
      "restore_carrier", [](py::handle carrier) { return RestoreCarrier(carrier.ptr()); },
      py::arg("carrier"), "Gives a pointed carrier its own handle back.");
  m.def("lazy_set_enabled", &SetLazyReadsEnabled, py::arg("on"));
  m.def("lazy_enabled", &LazyReadsEnabled);
  m.def(
      "lazy_read_loop",
      [](py::handle t, int64_t n) {
        const uintptr_t impl = ImplAddress(t.ptr());
        int64_t ok = 0;
        LazyFacts f;
        for (int64_t i = 0; i < n; ++i) ok += impl != 0 && ReadLazyFacts(impl, &f);
        return ok;
      },
      py::arg("tensor"), py::arg("n"),
      "Reads `tensor`'s facts `n` times natively (benchmarks: the cost of one read); returns "
      "how many reads succeeded.");
}

}  // namespace torch_xla_donate
