// See marking.h.
#include "marking/marking.h"

#include <c10/core/ScalarType.h>
#include <pybind11/pybind11.h>

#include <cctype>
#include <iterator>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/call_site.h"
#include "base/ledger.h"
#include "base/tensor_access.h"
#include "base/tensor_facts.h"
#include "base/variable.h"
#include "lazy/lazy_reads.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

// -- What marking reads besides the tensor ----------------------------------
//
// Set from Python: donation on (the switches, XLA_ENABLE_PARAM_ALIASING, the
// guards; _base/fast_path.py), a StaleReadWarning owed first, and how many
// threads hold the commit lock (_base/lock.py).  Marking runs with the GIL
// and calls no Python code, so no other Python thread runs in between; a
// commit in progress on another thread holds the lock, and a mark then
// waits for it (kCommitting: Python takes the lock and asks again).
bool g_on = false;
bool g_warn_first = false;
bool g_decided = false;  // the guards ran (_base/guards.py)
int g_lock_holders = 0;

// The classes poisoning has a twin for (outcomes/poison.h): a tensor of
// any other class is refused until Python made one (kNewClass).
std::unordered_map<PyTypeObject*, PyObject*> g_twins;

// XLA's short names of torch's dtypes (f32[2,3]), as XLA and JAX print them;
// torch's own name for the others.
DtypeName DtypeNameOf(int scalar_type) {
  static std::unordered_map<int, DtypeName> names;
  auto it = names.find(scalar_type);
  if (it != names.end()) return it->second;
  using S = c10::ScalarType;
  static const std::pair<S, const char*> kXla[] = {
      {S::Float, "f32"},  {S::Double, "f64"}, {S::Half, "f16"},         {S::BFloat16, "bf16"},
      {S::Char, "s8"},    {S::Short, "s16"},  {S::Int, "s32"},          {S::Long, "s64"},
      {S::Byte, "u8"},    {S::Bool, "pred"},  {S::ComplexFloat, "c64"}, {S::ComplexDouble, "c128"},
      {S::UInt16, "u16"}, {S::UInt32, "u32"}, {S::UInt64, "u64"},
  };
  std::string name;
  const auto st = static_cast<S>(scalar_type);
  for (const auto& [s, n] : kXla)
    if (s == st) name = n;
  if (name.empty()) {
    name = c10::toString(st);
    for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  return names.emplace(scalar_type, InternDtype(name)).first->second;
}

// What a mark records of a tensor that passed the rules.
struct Candidate {
  Dims shape;
  DtypeName dtype = nullptr;
  int64_t nbytes = 0;
  int64_t version = -1;
};

// Whether the tensor's buffer is its own: not one torch_xla files under an
// older tensor (a copy or clone made since the last barrier reads its
// source's buffer until the next barrier).  No live buffer (an output still
// computing) is nobody else's; -1: an upload no graph read, its one tensor's.
bool OwnsItsBuffer(const LazyFacts& f) {
  if (!f.has_value) return true;
  int64_t owner;
  if (f.has_handle && !f.has_ir) {
    owner = f.tensor_id;  // torch_xla files such a buffer under the tensor itself
  } else if (f.ir_is_device_data) {
    owner = f.owner_tensor_id;
  } else {
    return true;
  }
  return owner == -1 || owner >= f.tensor_id;
}

// The rules of metadata alone (no torch_xla read): the device, a view, a
// scalar.  Also asked of a FakeTensor while dynamo traces a compiled
// function (classify_meta, _marking/graph_ops.py).
Refusal ClassifyMeta(PyObject* t, TensorFacts* facts) {
  const uintptr_t impl = ImplAddress(t);
  if (impl == 0) return Refusal::kNotTensor;
  if (!ReadTensorFacts(impl, facts)) return Refusal::kPending;  // torch raised: no plain tensor
  if (!facts->is_xla) return Refusal::kNotXla;
  if (facts->has_autograd_meta && IsView(t)) return Refusal::kView;
  if (facts->symbolic_sizes) return Refusal::kPending;  // no concrete shape to record
  if (facts->sizes.empty()) return Refusal::kZeroDim;
  return Refusal::kNone;
}

// Every rule of marking, in order; fills `c` when it returns kNone.
// `held_ok`: Python judged the tensor's aliases and they may go with it.
// `locked`: the caller holds the commit lock.
Refusal Classify(PyObject* t, bool held_ok, bool locked, Candidate* c) {
  if (!IsTensor(t)) return Refusal::kNotTensor;
  if (IsDonatedType(t)) return Refusal::kPoisoned;
  const uintptr_t impl = ImplAddress(t);
  if (HasPythonDispatch(impl)) return Refusal::kWrapper;  // no XLA buffer of its own
  if (g_twins.find(Py_TYPE(t)) == g_twins.end()) return Refusal::kNewClass;
  TensorFacts facts;
  const Refusal meta = ClassifyMeta(t, &facts);
  if (meta != Refusal::kNone) return meta;
  if (!g_decided) return Refusal::kUndecided;
  if (LazyReadsEnabled()) {  // off once a guard failed: then donation is off too
    LazyFacts lazy;
    if (!ReadLazy(t, &lazy) || lazy.pending || !(lazy.has_handle || lazy.ir_is_device_data))
      return Refusal::kPending;
    if (!OwnsItsBuffer(lazy)) return Refusal::kCopy;
  }
  if (!g_on) return Refusal::kOff;
  if (g_warn_first) return Refusal::kWarnFirst;
  if (!locked && g_lock_holders > 0) return Refusal::kCommitting;
  if (!held_ok && (facts.storage_use_count > 1 || HeldByAutograd(t, facts) != 0))
    return Refusal::kHeld;
  int64_t numel = 1;
  for (int64_t d : facts.sizes) numel *= d;
  c->shape = facts.sizes;
  c->dtype = DtypeNameOf(facts.scalar_type);
  c->nbytes = numel * facts.itemsize;
  c->version = facts.version;
  return Refusal::kNone;
}

int IntArg(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t i, int fallback) {
  if (nargs <= i) return fallback;
  const long v = PyLong_AsLong(args[i]);
  if (v == -1 && PyErr_Occurred()) return -1;
  return static_cast<int>(v);
}

// try_mark(tensor, via=0, where=1, held_ok=False, locked=False) -> int
//
// Marks `tensor` for the next execution that takes it, blaming `where` (a
// frame depth from the Python function that called this, or (file, line));
// 0 (Refusal::kNone) once marked, marking twice counting once; else the
// Refusal, nothing changed.
PyObject* TryMark(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 5) {
    PyErr_SetString(PyExc_TypeError,
                    "try_mark(tensor, via=0, where=1, held_ok=False, locked=False)");
    return nullptr;
  }
  const int via = IntArg(args, nargs, 1, 0);
  if (via < 0 || via >= kViaCount) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "try_mark(): no such via");
    return nullptr;
  }
  const bool held_ok = nargs > 3 && PyObject_IsTrue(args[3]) == 1;
  const bool locked = nargs > 4 && PyObject_IsTrue(args[4]) == 1;
  PyObject* t = args[0];
  Candidate c;
  const Refusal r = Classify(t, held_ok, locked, &c);
  if (r != Refusal::kNone) return PyLong_FromLong(static_cast<long>(r));
  static PyObject* const kCaller = PyLong_FromLong(1);
  FilePtr file;
  int line = 0;
  if (!ResolveWhere(nargs > 2 ? args[2] : kCaller, &file, &line)) return nullptr;
  GlobalLedger().Mark(py::reinterpret_borrow<py::object>(t), file, line, std::move(c.shape),
                      c.dtype, c.nbytes, static_cast<Via>(via), c.version);
  return PyLong_FromLong(0);
}

// try_mark_all(tensors, via, where, locked=False) -> (refusal, index or count)
//
// donate(tree)'s marks, all or nothing: every tensor of the (distinct)
// list is checked first, a scalar skipped (donate() never donates one);
// then all are marked and (0, how many of them are marked now) returned.
// Otherwise (the first refusal, its index), nothing marked.
PyObject* TryMarkAll(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 3 || nargs > 4 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "try_mark_all(list_of_tensors, via, where, locked=False)");
    return nullptr;
  }
  const int via = IntArg(args, nargs, 1, 0);
  if (via < 0 || via >= kViaCount) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "try_mark_all(): no such via");
    return nullptr;
  }
  const bool locked = nargs > 3 && PyObject_IsTrue(args[3]) == 1;
  PyObject* list = args[0];
  const Py_ssize_t n = PyList_GET_SIZE(list);
  std::vector<std::pair<PyObject*, Candidate>> todo;
  todo.reserve(n);
  long marked = 0;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(list, i);
    if (IsTensor(t) && GlobalLedger().IsMarked(py::handle(t))) {
      ++marked;
      continue;
    }
    Candidate c;
    const Refusal r = Classify(t, /*held_ok=*/false, locked, &c);
    if (r == Refusal::kZeroDim) continue;
    if (r != Refusal::kNone) return Py_BuildValue("(in)", static_cast<int>(r), i);
    todo.emplace_back(t, std::move(c));
  }
  FilePtr file;
  int line = 0;
  if (!ResolveWhere(args[2], &file, &line)) return nullptr;
  for (auto& [t, c] : todo)
    marked +=
        GlobalLedger().Mark(py::reinterpret_borrow<py::object>(t), file, line, std::move(c.shape),
                            c.dtype, c.nbytes, static_cast<Via>(via), c.version);
  return Py_BuildValue("(il)", 0, marked);
}

// mark_graph_op(tensor, where, with_version) -> bool
//
// A compiled graph's own donation (_hooks/dynamo.py), judged while dynamo
// traced it (classify_meta) and by the commit that takes it: recorded as
// it is, its version only `with_version` (a mark the graph only makes,
// waiting for the next execution, as eager marks wait).  False if it was
// marked already.
PyObject* MarkGraphOp(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "mark_graph_op(tensor, where, with_version)");
    return nullptr;
  }
  PyObject* t = args[0];
  const uintptr_t impl = ImplAddress(t);
  TensorFacts facts;
  if (impl == 0 || !ReadTensorFacts(impl, &facts) || facts.symbolic_sizes) {
    PyErr_SetString(PyExc_TypeError, "mark_graph_op() needs a tensor of a concrete shape");
    return nullptr;
  }
  FilePtr file;
  int line = 0;
  if (!ResolveWhere(args[1], &file, &line)) return nullptr;
  int64_t numel = 1;
  for (int64_t d : facts.sizes) numel *= d;
  const bool marked =
      GlobalLedger().Mark(py::reinterpret_borrow<py::object>(t), file, line, facts.sizes,
                          DtypeNameOf(facts.scalar_type), numel * facts.itemsize, Via::kGraphOp,
                          PyObject_IsTrue(args[2]) == 1 ? facts.version : -1);
  return PyBool_FromLong(marked);
}

PyMethodDef kMethods[] = {
    {"mark_graph_op", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(MarkGraphOp)),
     METH_FASTCALL,
     "mark_graph_op(tensor, where, with_version) -> bool\n\nRecords a compiled graph's own "
     "donation as it is (dynamo and the commit judge it)."},
    {"try_mark", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(TryMark)),
     METH_FASTCALL,
     "try_mark(tensor, via=0, where=1, held_ok=False, locked=False) -> int\n\nMarks the tensor "
     "if every rule of marking passes: 0 (Refusal.NONE), else the Refusal, nothing changed."},
    {"try_mark_all", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(TryMarkAll)),
     METH_FASTCALL,
     "try_mark_all(tensors, via, where, locked=False) -> (refusal, index or count)\n\nMarks "
     "distinct tensors all or nothing (scalars skipped): (0, how many are marked), or the "
     "first refusal and its index."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void RegisterMarking(PyObject* module) {
  if (PyModule_AddFunctions(module, kMethods) < 0) throw py::error_already_set();
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  // An IntEnum: it compares as the int try_mark returns.
  static const char* const kNames[] = {
      "NONE", "NOT_TENSOR", "WRAPPER",    "POISONED",   "NEW_CLASS", "NOT_XLA", "VIEW", "ZERO_DIM",
      "OFF",  "UNDECIDED",  "WARN_FIRST", "COMMITTING", "PENDING",   "COPY",    "HELD"};
  static_assert(std::size(kNames) == static_cast<size_t>(Refusal::kHeld) + 1, "a name each");
  py::list members;
  for (size_t i = 0; i < std::size(kNames); ++i) members.append(py::make_tuple(kNames[i], i));
  m.attr("Refusal") = py::module_::import("enum").attr("IntEnum")(
      "Refusal", members, py::arg("module") = "torch_xla_donate._C");
  m.def(
      "shape_string",
      [](py::handle t) -> std::string {
        const uintptr_t impl = ImplAddress(t.ptr());
        TensorFacts facts;
        if (impl == 0 || !ReadTensorFacts(impl, &facts) || facts.symbolic_sizes)
          throw py::type_error("shape_string() needs a tensor of a concrete shape");
        Record r;
        r.dtype = DtypeNameOf(facts.scalar_type);
        r.shape = facts.sizes;
        return r.ShapeString();
      },
      py::arg("tensor"), "The tensor's dtype and shape as XLA prints them (f32[2,3]).");
  m.def(
      "classify_meta",
      [](py::handle t) {
        TensorFacts facts;
        return static_cast<int>(ClassifyMeta(t.ptr(), &facts));
      },
      py::arg("tensor"),
      "The rules of metadata alone (device, view, scalar), also for a FakeTensor: a Refusal.");
  m.def(
      "register_twin",
      [](py::handle cls, py::handle twin) {
        if (!PyType_Check(cls.ptr()) || !PyType_Check(twin.ptr()))
          throw py::type_error("register_twin(cls, twin) takes two classes");
        auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
        if (g_twins.count(type)) return;
        Py_INCREF(cls.ptr());  // the key's address must not be reused
        Py_INCREF(twin.ptr());
        g_twins.emplace(type, twin.ptr());
      },
      py::arg("cls"), py::arg("twin"),
      "Tensors of `cls` may be marked: poisoning gives them `twin` (poison.py).");
  m.def(
      "twin_of",
      [](py::handle cls) -> py::object {
        auto it = g_twins.find(reinterpret_cast<PyTypeObject*>(cls.ptr()));
        return it == g_twins.end() ? py::object(py::none())
                                   : py::reinterpret_borrow<py::object>(it->second);
      },
      py::arg("cls"), "The poisoned twin registered for `cls`, or None.");
  m.def(
      "set_marking_state",
      [](bool on, bool warn_first, bool decided) {
        g_on = on;
        g_warn_first = warn_first;
        g_decided = decided;
      },
      py::arg("on"), py::arg("warn_first"), py::arg("decided"),
      "Whether donation is on, whether a StaleReadWarning is owed first, and whether the "
      "guards ran.");
  m.def(
      "note_lock", [](bool acquired) { g_lock_holders += acquired ? 1 : -1; }, py::arg("acquired"),
      "The commit lock (_base/lock.py) was acquired (True) or released (False).");
  m.def("lock_holders", []() { return g_lock_holders; });
}

PyObject* TwinClassOf(PyTypeObject* type) {
  auto it = g_twins.find(type);
  return it == g_twins.end() ? nullptr : it->second;
}

}  // namespace torch_xla_donate
