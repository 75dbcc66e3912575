// The leanest design that keeps poisoning and per-donation verdicts: the
// bound tools/lean_bound/run.py measures the plugin against.  Never built
// into the package: run.py drops it into a throw-away copy's csrc/.
//
// Per donor and step it does what no design with those promises can skip,
// and nothing else: the native reads marking makes, torch_xla's donor flag
// armed at the barrier (raw donation's own call, moved), the buffer kept for
// the verdict, the tensor poisoned after the barrier, and at the next step
// one read of whether the buffer was consumed.  No record per donation (one
// shared record tags every poisoned tensor), no ledger, no entries, no checks
// of holders, copies or in-place updates, no Python hook.
#include <vector>

#include "reads.h"

namespace torch_xla_donate {
namespace {
std::vector<PyObject*> g_marked;       // strong references until the barrier
std::vector<HeldBuffer> g_in_flight;  // the buffers the verdicts read
long g_consumed = 0, g_read = 0, g_verdicts = 0;
}  // namespace

void RegisterLeanBound(py::module_& m) {
  m.def("lean_mark", [](py::handle t) {
    TensorFacts facts;
    LazyFacts lazy;
    if (Facts(t.ptr(), &facts, true) == 1 && ReadLazy(t.ptr(), &lazy)) ++g_read;
    Py_INCREF(t.ptr());
    g_marked.push_back(t.ptr());
  });
  m.def("lean_arm", [](py::handle set_donation) {
    for (PyObject* t : g_marked) {
      PyObject* r = PyObject_CallFunctionObjArgs(set_donation.ptr(), t, Py_True, nullptr);
      if (!r) throw py::error_already_set();
      Py_DECREF(r);
    }
  });
  m.def("lean_after", [](py::handle record) {
    const RecordPtr& tag = RecordArg(record.ptr());
    for (PyObject* t : g_marked) {
      if (HeldBuffer b = TakeBuffer(ImplAddress(t))) g_in_flight.push_back(std::move(b));
      if (Poison(t, tag) != 0) throw py::error_already_set();
      Py_DECREF(t);
    }
    g_marked.clear();
  });
  // (consumed, read, verdicts) so far: the caller checks the work was done.
  m.def("lean_settle", []() {
    for (const HeldBuffer& b : g_in_flight) {
      g_consumed += HeldBufferConsumed(b);
      ++g_verdicts;
    }
    g_in_flight.clear();
    return py::make_tuple(g_consumed, g_read, g_verdicts);
  });
}

}  // namespace torch_xla_donate
