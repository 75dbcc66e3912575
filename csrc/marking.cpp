// Marking: every rule of what can be marked (Classify), the mark, and the state marking reads
// (the switches and the commit lock, owned here).
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <thread>

#include "reads.h"

namespace torch_xla_donate {
namespace {

// -- The switches: set from Python (configure, the guards, the environment).
struct Switches {
  bool enabled = true, strict = false, auto_ = false;
  bool hooks_in = false;  // without the step hook nothing would commit a mark
  bool aliasing = true;   // torch_xla's XLA_ENABLE_PARAM_ALIASING
  bool decided = false;   // the guards ran
  bool warn_first = false;
  std::string failure;  // the guard that failed, if one did: donation off
  bool on() const { return enabled && aliasing && failure.empty(); }
};
Switches g_switches;
constexpr std::pair<const char*, bool Switches::*> kFlags[] = {
    {"enabled", &Switches::enabled},      {"strict", &Switches::strict},
    {"auto", &Switches::auto_},           {"hooks_in", &Switches::hooks_in},
    {"aliasing", &Switches::aliasing},    {"decided", &Switches::decided},
    {"warn_first", &Switches::warn_first}};

// -- The commit lock: re-entrant, waited for without the GIL; a mark made while another thread
// commits waits for it (COMMITTING).
struct CommitLock {
  std::mutex mu;
  std::condition_variable free;
  std::thread::id owner;
  std::atomic<int> depth{0};

  void Acquire() {
    const auto me = std::this_thread::get_id();
    if (depth.load() > 0 && owner == me) {
      ++depth;
      return;
    }
    py::gil_scoped_release no_gil;
    std::unique_lock<std::mutex> lock(mu);
    free.wait(lock, [&] { return depth.load() == 0; });
    owner = me;
    depth = 1;
  }
  void Release() {
    std::lock_guard<std::mutex> lock(mu);
    if (depth.load() == 0 || owner != std::this_thread::get_id())
      throw std::runtime_error("the commit lock is not held by this thread");
    if (--depth == 0) {
      owner = std::thread::id();
      free.notify_one();
    }
  }
};

CommitLock& Lock() {
  static CommitLock* lock = new CommitLock();  // leaked: threads may wait on it at exit
  return *lock;
}

// A buffer torch_xla files under an older tensor is a copy's (made since the last barrier).
bool OwnsItsBuffer(const LazyFacts& f) {
  if (!f.has_value) return true;
  int64_t owner;
  if (f.has_handle && !f.has_ir)
    owner = f.tensor_id;
  else if (f.ir_is_device_data)
    owner = f.owner_tensor_id;
  else
    return true;
  return owner == -1 || owner >= f.tensor_id;
}

// The rules of metadata alone (device, view, scalar), also for a FakeTensor while dynamo traces.
Refusal ClassifyMeta(PyObject* t, TensorFacts* facts) {
  const uintptr_t impl = ImplAddress(t);
  if (impl == 0) return Refusal::NOT_TENSOR;
  if (!ReadTensorFacts(impl, facts)) return Refusal::PENDING;
  if (!facts->is_xla) return Refusal::NOT_XLA;
  if (facts->has_autograd_meta && IsView(t)) return Refusal::VIEW;
  if (facts->symbolic_sizes) return Refusal::PENDING;
  if (facts->sizes.empty()) return Refusal::ZERO_DIM;
  return Refusal::NONE;
}

// Every rule of marking, in order; fills `record` for NONE.  `held_ok`: its aliases may go with it.
Refusal Classify(PyObject* t, bool held_ok, bool locked, Record* record) {
  if (!IsTensor(t)) return Refusal::NOT_TENSOR;
  if (IsDonatedType(t)) return Refusal::POISONED;
  if (HasPythonDispatch(ImplAddress(t))) return Refusal::WRAPPER;  // no buffer of its own
  if (!TwinClassOf(Py_TYPE(t))) return Refusal::NEW_CLASS;
  TensorFacts facts;
  const Refusal meta = ClassifyMeta(t, &facts);
  if (meta != Refusal::NONE) return meta;
  if (!g_switches.decided) return Refusal::UNDECIDED;
  if (LazyReadsEnabled()) {  // off once a guard failed, and donation with them
    LazyFacts lazy;
    if (!ReadLazy(t, &lazy) || lazy.pending || !(lazy.has_handle || lazy.ir_is_device_data))
      return Refusal::PENDING;
    if (!OwnsItsBuffer(lazy)) return Refusal::COPY;
  }
  if (!(g_switches.on() && g_switches.hooks_in)) return Refusal::OFF;
  if (g_switches.warn_first) return Refusal::WARN_FIRST;
  if (!locked && Lock().depth.load() > 0) return Refusal::COMMITTING;
  if (!held_ok && (facts.storage_use_count > 1 || HeldByAutograd(t, facts))) return Refusal::HELD;
  int64_t numel = 1;
  for (int64_t d : facts.sizes) numel *= d;
  record->shape = facts.sizes;
  record->dtype = DtypeNameOf(facts.scalar_type);
  record->nbytes = numel * facts.itemsize;
  record->version = facts.version;
  return Refusal::NONE;
}

bool MarkNow(PyObject* t, RecordPtr record, PyObject* where, Via via) {
  if (!ResolveWhere(where, &record->file, &record->line)) return false;
  record->via = via;
  GlobalLedger().Mark(py::reinterpret_borrow<py::object>(t), std::move(record));
  return true;
}

int IntArg(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t i, int fallback, int limit) {
  const long v = nargs > i ? PyLong_AsLong(args[i]) : fallback;
  if (v == -1 && PyErr_Occurred()) return -1;
  if (v < 0 || v >= limit) {
    PyErr_SetString(PyExc_ValueError, "no such value");
    return -1;
  }
  return static_cast<int>(v);
}

// donate_buffer(tensor): one native call when it marks; a refusal goes to Python
// (_marking.refused), which words or resolves it: the path's one call into Python.
PyObject* DonateBuffer(PyObject*, PyObject* t) {
  if (!g_hooks.on_refusal) {
    PyErr_SetString(PyExc_RuntimeError, "import torch_xla_donate before its _C");
    return nullptr;
  }
  RecordPtr record = NewRecord();
  const Refusal r = Classify(t, false, false, record.get());
  static PyObject* const kCaller = PyLong_FromLong(0);
  if (r == Refusal::NONE) {
    if (!MarkNow(t, std::move(record), kCaller, Via::DONATE_BUFFER)) return nullptr;
    Py_RETURN_NONE;
  }
  FilePtr file;
  int line = 0;
  if (!ResolveWhere(kCaller, &file, &line)) return nullptr;
  return PyObject_CallFunction(g_hooks.on_refusal, "Oisi", t, static_cast<int>(r), file->c_str(),
                               line);
}

// try_mark(tensor, via=0, where=1, held_ok=False, locked=False) -> Refusal
PyObject* TryMark(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 1 || nargs > 5) {
    PyErr_SetString(PyExc_TypeError,
                    "try_mark(tensor, via=0, where=1, held_ok=False, locked=False)");
    return nullptr;
  }
  const int via = IntArg(args, nargs, 1, 0, kViaCount);
  if (via < 0) return nullptr;
  RecordPtr record = NewRecord();
  const Refusal r = Classify(args[0], nargs > 3 && PyObject_IsTrue(args[3]) == 1,
                             nargs > 4 && PyObject_IsTrue(args[4]) == 1, record.get());
  static PyObject* const kCaller = PyLong_FromLong(1);
  if (r == Refusal::NONE &&
      !MarkNow(args[0], std::move(record), nargs > 2 ? args[2] : kCaller, static_cast<Via>(via)))
    return nullptr;
  return PyLong_FromLong(static_cast<long>(r));
}

// try_mark_all(tensors, via, where, locked=False) -> (0, count) or (refusal, index); scalars
// skipped.
PyObject* TryMarkAll(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 3 || nargs > 4 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "try_mark_all(list_of_tensors, via, where, locked=False)");
    return nullptr;
  }
  const int via = IntArg(args, nargs, 1, 0, kViaCount);
  if (via < 0) return nullptr;
  const bool locked = nargs > 3 && PyObject_IsTrue(args[3]) == 1;
  std::vector<std::pair<PyObject*, RecordPtr>> todo;
  long marked = 0;
  for (Py_ssize_t i = 0, n = PyList_GET_SIZE(args[0]); i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(args[0], i);
    if (IsTensor(t) && GlobalLedger().IsMarked(py::handle(t))) {
      ++marked;
      continue;
    }
    RecordPtr record = NewRecord();
    const Refusal r = Classify(t, false, locked, record.get());
    if (r == Refusal::ZERO_DIM) continue;
    if (r != Refusal::NONE) return Py_BuildValue("(in)", static_cast<int>(r), i);
    todo.emplace_back(t, std::move(record));
  }
  for (auto& [t, record] : todo) {
    if (!MarkNow(t, std::move(record), args[2], static_cast<Via>(via))) return nullptr;
    ++marked;
  }
  return Py_BuildValue("(il)", 0, marked);
}

PyMethodDef kMethods[] = {
    {"donate_buffer", DonateBuffer, METH_O,
     "donate_buffer(tensor) -> None\n\n"
     "Donates `tensor`'s device buffer to the outputs of the next step: an output may then\n"
     "take the buffer, and `tensor` is poisoned (any use raises DonatedBufferError).  If no\n"
     "output can take it, the tensor keeps its value and an UnusedDonationWarning says so.\n"
     "Marking twice before a step counts once.  Under torch.compile it is a graph op.\n\n"
     "Raises TypeError for no torch.Tensor (or one that cannot be poisoned); ValueError for a\n"
     "tensor not on an XLA device, with pending computation (call torch_xla.sync() first), a\n"
     "view or one with live views or aliases, one an autograd graph saved, or a 0-dim\n"
     "scalar; DonatedBufferError if it was donated already."},
    {"try_mark", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(TryMark)),
     METH_FASTCALL, "try_mark(tensor, via=0, where=1, held_ok=False, locked=False) -> Refusal"},
    {"try_mark_all", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(TryMarkAll)),
     METH_FASTCALL, "try_mark_all(tensors, via, where, locked=False) -> (refusal, index|count)"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void RegisterMarking(py::module_& m) {
  Check(PyModule_AddFunctions(m.ptr(), kMethods) == 0);
  m.def(
      "mark_graph_op",
      [](py::handle t, py::handle where, bool with_version) {
        // A compiled graph's own: judged while dynamo traced and by the commit that takes it.
        TensorFacts facts;
        if (Facts(t.ptr(), &facts) != 1 || facts.symbolic_sizes)
          throw py::type_error("mark_graph_op() needs a tensor of a concrete shape");
        RecordPtr record = NewRecord();
        int64_t numel = 1;
        for (int64_t d : facts.sizes) numel *= d;
        record->shape = facts.sizes;
        record->dtype = DtypeNameOf(facts.scalar_type);
        record->nbytes = numel * facts.itemsize;
        record->version = with_version ? facts.version : -1;
        Check(ResolveWhere(where.ptr(), &record->file, &record->line));
        record->via = Via::GRAPH_OP;
        return GlobalLedger().Mark(py::reinterpret_borrow<py::object>(t), std::move(record));
      },
      py::arg("tensor"), py::arg("where"), py::arg("with_version"));
  m.def(
      "classify_meta",
      [](py::handle t) {
        TensorFacts facts;
        return static_cast<int>(ClassifyMeta(t.ptr(), &facts));
      },
      py::arg("tensor"), "The rules of metadata alone, also for a FakeTensor: a Refusal.");
  m.def(
      "shape_string",
      [](py::handle t) {
        Record r;
        TensorFacts facts;
        if (Facts(t.ptr(), &facts) != 1 || facts.symbolic_sizes)
          throw py::type_error("shape_string() needs a tensor of a concrete shape");
        r.dtype = DtypeNameOf(facts.scalar_type);
        r.shape = facts.sizes;
        return r.ShapeString();
      },
      py::arg("tensor"), "The dtype and shape as XLA prints them (f32[2,3]).");
  m.def(
      "set_switches",
      [](py::kwargs kwargs) {
        for (auto [key, value] : kwargs) {
          const std::string name = py::str(key);
          auto flag = std::find_if(std::begin(kFlags), std::end(kFlags),
                                   [&](const auto& f) { return name == f.first; });
          if (flag != std::end(kFlags))
            g_switches.*flag->second = value.cast<bool>();
          else if (name == "failure")
            g_switches.failure = value.is_none() ? "" : value.cast<std::string>();
          else
            throw py::type_error("set_switches(): no switch '" + name + "'");
        }
      },
      "Sets the switches given by name (the owner of each: _config.py, _guards.py).");
  m.def("switches", []() {
    py::dict d;
    for (const auto& [name, flag] : kFlags) d[name] = g_switches.*flag;
    d["failure"] =
        g_switches.failure.empty() ? py::object(py::none()) : py::str(g_switches.failure);
    d["on"] = g_switches.on();
    return d;
  });
  py::class_<CommitLock, std::unique_ptr<CommitLock, py::nodelete>>(m, "CommitLock")
      .def("acquire", &CommitLock::Acquire)
      .def("release", &CommitLock::Release)
      .def(
          "__enter__",
          [](CommitLock& l) -> CommitLock& {
            l.Acquire();
            return l;
          },
          py::return_value_policy::reference)
      .def("__exit__", [](CommitLock& l, py::args) { l.Release(); })
      .def_property_readonly("depth", [](CommitLock& l) { return l.depth.load(); });
  m.attr("lock") = py::cast(&Lock(), py::return_value_policy::reference);
}

}  // namespace torch_xla_donate
