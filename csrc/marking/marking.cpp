// See marking.h.
#include "marking/marking.h"

#include <pybind11/pybind11.h>

#include <string>
#include <utility>
#include <vector>

#include "base/call_site.h"
#include "base/ledger.h"
#include "base/py_types.h"
#include "base/tensor_access.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

// -- When the fast path may mark -------------------------------------------
//
// TryMark marks without taking the hook lock (_base/lock.py): it runs entirely in C++
// while holding the GIL and calls no Python code (only torch and torch_xla
// builtins), so no other Python thread runs in between.  That alone is not
// enough: another thread may hold the lock in the middle of a commit.  A mark
// then must wait for the lock, so while any thread holds it (_base/lock.py
// counts them here) the fast path declines and the Python path takes the
// lock.  The fast path is also closed while donation is switched off: the
// slow path warns then.
int g_lock_holders = 0;
bool g_fast_enabled = false;
// Every XLA tensor with an id up to this one existed at the end of the last
// barrier of every device, which gave each its own buffer: a copy or clone
// still sharing its source's buffer is newer (see ownership.py).  Newer
// tensors go to the Python path, which looks closer.
int64_t g_settled_ids = -1;
// True once one of torch_xla's own in-place functions ran since the last
// barrier (`_xla_optimization_barrier_`, the in-place collectives, the
// fused optimizer steps: _hooks/executions.py puts a trampoline on each).
// They give an XLA tensor a pending value without a new id or version, the
// two things that otherwise answer "pending?" for a functional tensor.
// Counted: a barrier records the count when it starts and passes it when it
// has run, so a call racing the barrier from another thread still counts.
uint64_t g_inplace_calls = 1;
uint64_t g_inplace_synced = 0;

bool FastPathOpen() {
  return g_lock_holders == 0 && g_fast_enabled && g_hooks.torch_bound() && g_hooks.poison_bound();
}

PyObject* FalseClearingErrors() {
  PyErr_Clear();
  Py_RETURN_FALSE;
}

// The checks of _marking/checks.py check_donatable that pass for an ordinary donation,
// except the pending-IR and 0-dim ones.  Fills `facts`.  1 pass, 0 fail,
// -1 error.
int CommonChecks(PyObject* t, TensorFacts* facts) {
  if (!IsPlainTensor(t)) return 0;
  int r = Facts(t, facts);
  if (r != 1) return r;
  if (!facts->is_xla || facts->storage_use_count != 1) return 0;
  if (facts->has_autograd_meta) {  // a view has autograd metadata
    r = IsView(t);
    if (r != 0) return r < 0 ? -1 : 0;
  }
  r = HeldByAutograd(t, *facts);
  if (r != 0) return r < 0 ? -1 : 0;
  return 1;
}

// A tensor that passed the checks, with what its ledger record needs.
struct Candidate {
  PyObject* tensor = nullptr;  // borrowed
  Dims shape;
  DtypeName dtype = nullptr;
  int64_t nbytes = 0;
  int64_t version = -1;
  bool is_functional = false;
  // torch_xla's facts, read in place once (ReadLazy); else the bound
  // callables are asked.
  bool lazy_read = false;
  LazyFacts lazy;
};

// The checks (plain XLA tensor, no view, no alias, not held by autograd,
// ordinary sizes), changing nothing.  True with `c` filled; false, errors
// cleared, when the Python path must decide.
bool Prepare(PyObject* t, Candidate* c) {
  TensorFacts facts;
  if (CommonChecks(t, &facts) != 1 || Describe(t, facts, &c->shape, &c->dtype, &c->nbytes) != 1) {
    PyErr_Clear();
    return false;
  }
  c->lazy_read = ReadLazy(t, &c->lazy);
  const int64_t id = c->lazy_read ? c->lazy.tensor_id : TensorId(t);
  if (id < 0 || id > g_settled_ids) {  // new since the last barrier: look closer
    PyErr_Clear();
    return false;
  }
  c->tensor = t;
  c->version = facts.version;
  c->is_functional = facts.is_functional;
  return true;
}

// Does torch_xla have to be asked whether `c` holds pending computation?
// Not for a functional tensor (torch_xla's default) while none of its own
// in-place functions ran since the last barrier: computed or updated in
// place since that barrier, it would wrap an XLA tensor newer than it,
// which Prepare's id check sends to the Python path.
bool MustAskPending(const Candidate& c) {
  return !c.is_functional || g_inplace_calls != g_inplace_synced;
}

// Pending computation?  1 / 0, -1 on error.
int Pending(const Candidate& c) {
  if (!MustAskPending(c)) return 0;
  return c.lazy_read ? (c.lazy.pending ? 1 : 0) : HasPendingIr(c.tensor);
}

Via ViaArg(PyObject* const* args, Py_ssize_t nargs, Py_ssize_t i) {
  if (nargs <= i) return Via::kDonateBuffer;
  long v = PyLong_AsLong(args[i]);
  if (v < 0 || v >= kViaCount) {
    PyErr_Clear();
    return Via::kDonateBuffer;
  }
  return static_cast<Via>(v);
}

// False if the tensor was marked already (the ledger changed nothing).
bool MarkCandidate(Candidate&& c, const FilePtr& file, int line, Via via) {
  return GlobalLedger().Mark(py::reinterpret_borrow<py::object>(c.tensor), file, line,
                             std::move(c.shape), c.dtype, c.nbytes, via, c.version);
}

// The fast path of one mark: 1 once `t` is marked (blaming `where`, see
// call_site.h); 0, having changed nothing and with no Python error, whenever
// anything is unusual (not a plain materialized XLA tensor, views alive,
// pending computation, already marked, donation switched off, a probe
// raised): the Python path then redoes everything and gives the precise
// error or warning.  -1 with a Python error only for a bad `where`.
int FastMark(PyObject* t, PyObject* where, Via via) {
  if (!FastPathOpen()) return 0;
  Candidate c;
  if (!Prepare(t, &c)) return 0;
  if (c.shape.empty()) return 0;  // 0-dim: api refuses it, with a reason
  FilePtr file;
  int line = 0;
  if (!ResolveWhere(where, &file, &line)) return -1;  // caller's bug
  if (Pending(c) != 0) {
    PyErr_Clear();
    return 0;
  }
  // Marked already: the ledger asks under the lock it marks with, once.
  return MarkCandidate(std::move(c), file, line, via) ? 1 : 0;
}

// try_mark(tensor, where, via=0) -> bool
//
// FastMark for the Python paths (donate(tree), donating): True once
// `tensor` is marked, False when the Python path must decide.
PyObject* TryMark(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 3) {
    PyErr_SetString(PyExc_TypeError, "try_mark(tensor, where, via=0) takes 2 or 3 arguments");
    return nullptr;
  }
  const int r = FastMark(args[0], args[1], ViaArg(args, nargs, 2));
  if (r < 0) return nullptr;
  return PyBool_FromLong(r);
}

// donate_buffer(tensor) -> None, the public function itself (see its
// docstring below).  Native, so that the common case costs one call from
// the user's line and no Python frame: FastMark blaming the caller (depth
// 0, as a builtin has no frame of its own), else the Python half, whose
// sys._getframe(1) is the user's frame for the same reason (the Python half,
// _marking/tensor.py donate_buffer_checked, is bound with C.bind).  While dynamo
// traces a call, _marking/tensor.py's polyfill stands in for it.
PyObject* DonateBuffer(PyObject*, PyObject* const* args, size_t nargsf, PyObject* kwnames) {
  const Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
  const Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  if (nargs + nkw != 1 ||
      (nkw == 1 && PyUnicode_CompareWithASCIIString(PyTuple_GET_ITEM(kwnames, 0), "tensor"))) {
    PyErr_SetString(PyExc_TypeError,
                    "donate_buffer() takes one argument, the tensor: donate_buffer(t). For the "
                    "tensors of a module, list or dict use donate(tree)");
    return nullptr;
  }
  PyObject* t = args[0];
  static PyObject* const kHere = PyLong_FromLong(0);  // the caller's frame
  const int r = FastMark(t, kHere, Via::kDonateBuffer);
  if (r < 0) return nullptr;
  if (r == 1) Py_RETURN_NONE;
  if (!g_hooks.donate_buffer_checked) {
    PyErr_SetString(PyExc_RuntimeError, "donate_buffer: import torch_xla_donate first");
    return nullptr;
  }
  return PyObject_Vectorcall(g_hooks.donate_buffer_checked, &t, 1, nullptr);
}

// is_donatable(tensor) -> bool: True if _marking/checks.py check_donatable would pass.
// False means "ask the Python checks", which raise the precise error.
PyObject* IsDonatable(PyObject*, PyObject* t) {
  if (!g_hooks.torch_bound()) Py_RETURN_FALSE;
  TensorFacts facts;
  if (CommonChecks(t, &facts) != 1) return FalseClearingErrors();
  LazyFacts lazy;
  const bool read = ReadLazy(t, &lazy);
  const int64_t id = read ? lazy.tensor_id : TensorId(t);
  if (id < 0 || id > g_settled_ids) return FalseClearingErrors();    // look closer
  if (facts.symbolic_sizes || facts.sizes.empty()) Py_RETURN_FALSE;  // 0-dim: api refuses it
  if (read ? lazy.pending : (HasPendingIr(t) != 0)) return FalseClearingErrors();
  Py_RETURN_TRUE;
}

// try_mark_all(tensors, where, via=0) -> int
//
// donate(tree)'s common case in one call, all or nothing: every tensor of
// the (deduplicated) list is a plain materialized XLA tensor that passes
// try_mark's checks, or already marked, or a materialized 0-dim scalar
// (skipped: donate() never donates scalars).  Then all are marked and the
// number of them now marked (scalars excluded) is returned.  Otherwise -1,
// having changed nothing: the Python path redoes the work and names the
// tensor at fault by its path.
PyObject* TryMarkAll(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs < 2 || nargs > 3 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "try_mark_all(list_of_tensors, where, via=0)");
    return nullptr;
  }
  // Called with the hook lock (_base/lock.py) held, so only the switches count here.
  if (!g_hooks.torch_bound() || !g_hooks.poison_bound() || !g_fast_enabled)
    return PyLong_FromLong(-1);
  FilePtr file;
  int line = 0;
  if (!ResolveWhere(args[1], &file, &line)) return nullptr;  // caller's bug
  std::vector<Candidate> todo;
  long already = 0;
  PyObject* list = args[0];
  // Pending IR: read with the facts where they were read, the rest asked
  // in one torch_xla call (see Pending()).
  py::list probe;
  for (Py_ssize_t i = 0, n = PyList_GET_SIZE(list); i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(list, i);
    if (GlobalLedger().IsMarked(py::handle(t))) {
      ++already;
      continue;
    }
    Candidate c;
    if (!Prepare(t, &c)) return PyLong_FromLong(-1);
    if (MustAskPending(c)) {
      if (c.lazy_read && c.lazy.pending) return PyLong_FromLong(-1);
      if (!c.lazy_read) probe.append(py::handle(t));
    }
    if (!c.shape.empty()) todo.push_back(std::move(c));  // a scalar is skipped
  }
  if (probe.size() > 0) {
    std::vector<char> pending;
    if (!PendingFlags(probe.ptr(), &pending)) {
      PyErr_Clear();
      return PyLong_FromLong(-1);
    }
    for (char p : pending)
      if (p) return PyLong_FromLong(-1);
  }
  const Via via = ViaArg(args, nargs, 2);
  long marked = already + static_cast<long>(todo.size());
  for (auto& c : todo) MarkCandidate(std::move(c), file, line, via);
  return PyLong_FromLong(marked);
}

const char kDonateBufferDoc[] = R"doc(donate_buffer(tensor)
--

Donates ``tensor``'s device buffer to the outputs of the next step.

At the next step barrier the buffer may hold one of the step's outputs;
``tensor`` is then poisoned and any use raises ``DonatedBufferError``.
If no output can take the buffer, the tensor keeps its value and an
``UnusedDonationWarning`` says so.  Marking twice before a step counts once.
Under ``torch.compile`` it is a graph op (no graph break): the compiled
graph donates the tensor.

Args:
  tensor: a materialized XLA tensor of at least one dimension.

Raises:
  TypeError: ``tensor`` is not a torch.Tensor (or cannot be poisoned).
  ValueError: it is not on an XLA device, has pending computation (call
    ``xm.mark_step()`` first), is a view or has live views/aliases, is
    saved for backward by a live autograd graph, or is a 0-dim scalar.
  DonatedBufferError: it was donated already.
)doc";

PyMethodDef kFastMethods[] = {
    {"donate_buffer", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(DonateBuffer)),
     METH_FASTCALL | METH_KEYWORDS, kDonateBufferDoc},
    {"try_mark", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(TryMark)),
     METH_FASTCALL,
     "try_mark(tensor, where, via=0) -> bool\n\nMarks a plain materialized XLA tensor in "
     "one call; False (nothing changed) when the Python path must decide."},
    {"try_mark_all", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(TryMarkAll)),
     METH_FASTCALL,
     "try_mark_all(tensors, where, via=0) -> int\n\nMarks a list of distinct plain "
     "materialized XLA tensors, all or nothing (0-dim ones skipped); -1 (nothing "
     "changed) when the Python path must decide."},
    {"is_donatable", IsDonatable, METH_O,
     "is_donatable(tensor) -> bool\n\nTrue when every check of donate_buffer "
     "passes; False when the Python checks must say why not."},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void RegisterMarking(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  if (PyModule_AddFunctions(module, kFastMethods) < 0) throw py::error_already_set();
  m.def(
      "set_fast_path_enabled", [](bool enabled) { g_fast_enabled = enabled; }, py::arg("enabled"),
      "Opens try_mark's fast path while donation is switched on (config and "
      "XLA_ENABLE_PARAM_ALIASING).");
  m.def(
      "note_lock", [](bool acquired) { g_lock_holders += acquired ? 1 : -1; }, py::arg("acquired"),
      "the hook lock (_base/lock.py) was acquired (True) or released (False): the fast path "
      "declines while anyone holds it.");
  m.def("lock_holders", []() { return g_lock_holders; });
  m.def(
      "note_inplace_xlac", []() { ++g_inplace_calls; },
      "One of torch_xla's in-place functions ran: ask for pending IR again.");
  m.def(
      "inplace_calls", []() { return g_inplace_calls; },
      "How many of torch_xla's in-place functions ran (a barrier notes it when it starts).");
  m.def(
      "barrier_passed", [](uint64_t calls) { g_inplace_synced = calls; }, py::arg("calls"),
      "A barrier that started when `calls` in-place functions had run synced every tensor of "
      "the only device: what they left pending has run.");
  m.def(
      "set_settled_ids", [](int64_t id) { g_settled_ids = id; }, py::arg("id"),
      "Every XLA tensor with an id up to `id` has its own buffer (set at each barrier).");
}

}  // namespace torch_xla_donate
