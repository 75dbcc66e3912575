// See commit_fast.h.
#include "hooks/commit_fast.h"

#include <pybind11/pybind11.h>

#include <vector>

#include "base/ledger.h"
#include "base/py_types.h"
#include "base/scratch.h"
#include "base/tensor_access.h"
#include "lazy/lazy_reads.h"
#include "lazy/live_tensors.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

// Whether the donor `t` (its mark's `record`) is plain in every way the
// commit's checks look at, read once: a materialized XLA tensor not updated
// in place since marking, no view, alias or autograd graph holding it, no
// holder of its buffer or XLA tensor beyond its own (lazy_reads.h
// expected_holders), functional, with a buffer of its own the walk can
// match (`key`).  False when any of it is not so, or cannot be read: the
// Python stages then decide, with the precise reasons.
bool Plain(PyObject* t, const Record& record, DonorKey* key) {
  TensorFacts facts;
  if (Facts(t, &facts, /*with_sizes=*/false) != 1 || !facts.is_xla) return false;
  if (record.UpdatedSinceMarking(facts.version)) return false;
  if (facts.storage_use_count > 1) return false;   // views or aliases alive
  if (facts.storage_use_count == 0) return false;  // no storage read: ask Python
  if (HeldByAutograd(t, facts) != 0) {
    PyErr_Clear();
    return false;
  }
  LazyFacts lazy;
  if (!ReadLazy(t, &lazy) || !lazy.is_functional || !lazy.has_handle || lazy.pending) return false;
  if (!lazy.only_own_holders()) return false;
  return DonorKeyOfFacts(lazy, key);
}

// Clears the flag `SetDonor` set on the first `n` tensors.
void DisarmFirst(PyObject* const* tensors, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (SetDonor(tensors[i], false) < 0) PyErr_Clear();
}

// commit_fast() -> (step, tensors, records, donors)
//
// Takes every mark into a new step (begin_step) and, when each donor is
// plain (Plain), no live tensor is a copy made from one in this step (the
// walk, live_tensors.h) and torch_xla accepts each donor flag, arms them
// all and returns the armed entries as `donors`, with `tensors` and
// `records` None: the decide and arm stages of _hooks/commit.py in one
// pass, for the common step.  Otherwise `donors` is None and nothing was
// settled or armed: the caller runs those stages on `tensors` and
// `records`, as after begin_step.  Its vectors are the thread's scratch
// (base/scratch.h): the common step asks malloc for one block, the list of
// entries.
py::tuple CommitFast() {
  RequireBound();
  Scratch<py::object> owned;  // before the records: let go of last
  Scratch<RecordPtr> recs;
  const int64_t step = GlobalLedger().BeginStep(owned.get(), recs.get());
  const size_t n = owned->size();
  // The Python stages' lists, for them alone: the entries of the common
  // step make their records' Python faces when Python first asks.
  auto undecided = [&]() {
    py::list tensors(n);
    for (size_t i = 0; i < n; ++i)
      PyList_SET_ITEM(tensors.ptr(), static_cast<Py_ssize_t>(i), (*owned)[i].inc_ref().ptr());
    PyObject* records = RecordList(*recs);
    if (!records) throw py::error_already_set();
    return py::make_tuple(step, tensors, py::reinterpret_steal<py::list>(records), py::none());
  };
  if (n == 0) return py::make_tuple(step, py::none(), py::none(), py::list());  // nothing to do
  if (!LazyReadsEnabled() || LiveTensorArena() == 0) return undecided();
  Scratch<PyObject*> items_of;
  items_of->reserve(n);
  for (const py::object& t : *owned) items_of->push_back(t.ptr());
  PyObject* const* items = items_of->data();
  PrefetchTensors(items, static_cast<Py_ssize_t>(n));
  Scratch<DonorKey> keys;
  keys->resize(n);
  for (size_t i = 0; i < n; ++i)
    if (!Plain(items[i], *(*recs)[i], &(*keys)[i])) return undecided();
  Scratch<std::vector<int64_t>> copies;
  bool walked;
  {
    py::gil_scoped_release no_gil;
    walked = SameStepCopies(*keys, copies.get());
  }
  if (!walked) return undecided();
  for (const auto& found : *copies)
    if (!found.empty()) return undecided();
  for (size_t i = 0; i < n; ++i) {
    const int armed = SetDonor(items[i], true);
    if (armed != 1) {
      if (armed < 0) PyErr_Clear();
      DisarmFirst(items, i);
      return undecided();
    }
  }
  py::list donors(n);
  for (size_t i = 0; i < n; ++i) {
    PyObject* entry = NewEntry(items[i], (*recs)[i]);
    if (!entry) {
      PyErr_Clear();
      DisarmFirst(items, n);
      return undecided();
    }
    PyList_SET_ITEM(donors.ptr(), static_cast<Py_ssize_t>(i), entry);
  }
  return py::make_tuple(step, py::none(), py::none(), donors);
}

}  // namespace

void RegisterCommitFast(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  m.def("commit_fast", &CommitFast,
        "commit_fast() -> (step, tensors, records, donors): begin_step, then the commit's "
        "checks and arming in one pass; donors None when the Python stages must decide, "
        "tensors and records None when they need not.");
}

}  // namespace torch_xla_donate
