// See commit.h.
#include "hooks/commit.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <vector>

#include "base/ledger.h"
#include "base/py_types.h"
#include "base/scratch.h"
#include "base/tensor_access.h"
#include "lazy/reaper.h"
#include "outcomes/poison.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

PyObject* TensorOf(PyObject* entry, const RecordPtr** record) {
  PyObject* t;
  if (!EntryParts(entry, &t, record)) throw py::type_error("expected (tensor, record) entries");
  return t;
}

void AppendEntry(py::list& out, PyObject* t, PyObject* rec) {
  PyObject* entry = NewEntry(t, rec);
  Check(entry != nullptr);
  int appended = PyList_Append(out.ptr(), entry);
  Py_DECREF(entry);
  Check(appended == 0);
}

// The tensors of `entries` (a list), prefetched (tensor_access.h
// PrefetchTensors): the Entry objects first, then what they hold.
void PrefetchEntryTensors(PyObject* entries) {
  const Py_ssize_t n = PyList_GET_SIZE(entries);
  PyObject** items = PySequence_Fast_ITEMS(entries);
  for (Py_ssize_t first = 0; first < n; first += kPrefetchGroup) {
    const Py_ssize_t end = std::min<Py_ssize_t>(n, first + kPrefetchGroup);
    PyObject* tensors[kPrefetchGroup];
    Py_ssize_t count = 0;
    for (Py_ssize_t i = first; i < end; ++i) __builtin_prefetch(items[i]);
    for (Py_ssize_t i = first; i < end; ++i) {
      PyObject* t;
      const RecordPtr* rec;
      if (EntryParts(items[i], &t, &rec) && t != Py_None) tensors[count++] = t;
    }
    PrefetchTensors(tensors, count);
  }
}

// Splits a committed step (`tensors`, `records`, with `pending`: which ones
// hold pending IR) into donors and the ones whose holders must be looked at:
//  * pending, or its version counter moved: updated in place after marking,
//    an output: UPDATED_IN_PLACE;
//  * views or aliases alive, or held by autograd: returned as `held`
//    entries, unsettled, for ownership.py to decide;
//  * the rest are donors.
// Returns (donors, held), both lists of Entry.
py::tuple SplitCommitted(py::list tensors, py::list records, py::object pending) {
  RequireBound();
  py::list donors, held;
  const size_t n = tensors.size();
  if (records.size() != n) throw py::value_error("tensors and records differ in length");
  if (n == 0) return py::make_tuple(donors, held);
  py::list flags = py::list(pending);
  if (flags.size() != n) throw py::value_error("pending differs in length");
  for (size_t i = 0; i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(tensors.ptr(), i);
    PyObject* rec = PyList_GET_ITEM(records.ptr(), i);
    const RecordPtr& record = RecordArg(rec);
    int is_pending = PyObject_IsTrue(PyList_GET_ITEM(flags.ptr(), i));
    Check(is_pending >= 0);
    if (is_pending) {
      GlobalLedger().Settle(record, Verdict::kUpdatedInPlace);
      continue;
    }
    TensorFacts facts;
    const int read = Facts(t, &facts, /*with_sizes=*/false);
    Check(read >= 0);
    if (read == 1 && record->UpdatedSinceMarking(facts.version)) {
      // Updated in place since marking, and already materialized by a flush
      // that committed nothing (a step block's): its new value is no donor.
      GlobalLedger().Settle(record, Verdict::kUpdatedInPlace);
      continue;
    }
    long uses = StorageUseCount(t, read, facts);
    Check(!(uses == -1 && PyErr_Occurred()));
    int by_autograd = uses <= 1 && read == 1 ? HeldByAutograd(t, facts) : 0;
    Check(by_autograd >= 0);
    AppendEntry(uses > 1 || by_autograd ? held : donors, t, rec);
  }
  return py::make_tuple(donors, held);
}

// pending_flags(tensors) -> [bool]: pending computation, per tensor (as
// torch_xla's _check_tensor_need_materialization), read in place where
// native reads answer, the rest in one call of torch_xla's (_base/reads.py
// pending_flags is its selector).
py::list PendingFlagsOf(py::list tensors) {
  RequireBound();
  std::vector<char> flags;
  Check(PendingFlags(tensors.ptr(), &flags));
  py::list out(flags.size());
  for (size_t i = 0; i < flags.size(); ++i) {
    PyObject* b = flags[i] ? Py_True : Py_False;
    Py_INCREF(b);
    PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), b);
  }
  return out;
}

// Sets torch_xla's donor flag on the buffer each donor holds now.  Returns
// (armed, refused): torch_xla refuses a tensor that is no plain device data.
py::tuple Arm(py::list donors) {
  RequireBound();
  py::list armed, refused;
  for (size_t i = 0, n = donors.size(); i < n; ++i) {
    PyObject* entry = PyList_GET_ITEM(donors.ptr(), i);
    const RecordPtr* rec;
    PyObject* t = TensorOf(entry, &rec);
    int ok = SetDonor(t, true);
    if (ok < 0) PyErr_Clear();
    Check(PyList_Append((ok == 1 ? armed : refused).ptr(), entry) == 0);
  }
  return py::make_tuple(armed, refused);
}

// Clears the donor flag of every entry that holds its tensor.  Never raises
// for one tensor: a buffer a step consumed keeps a flag nothing can read
// any more.  An entry that keeps only its buffer (released or weakened) is
// skipped: its verdict, or the next commit, clears that flag
// (`disarm_held`).
void Disarm(py::list entries) {
  RequireBound();
  for (size_t i = 0, n = entries.size(); i < n; ++i) {
    PyObject* entry = PyList_GET_ITEM(entries.ptr(), i);
    const RecordPtr* rec;
    PyObject* t = TensorOf(entry, &rec);
    if (t != Py_None && SetDonor(t, false) < 0) PyErr_Clear();
  }
}

// Hands `t`'s buffer to `entry` through `keep` (ReleaseEntryTensor or
// WeakenEntryTensor).  False, nothing changed, if the buffer cannot be read
// or the entry cannot take it (a tuple).
bool KeepBuffer(PyObject* entry, PyObject* t, bool (*keep)(PyObject*, HeldBuffer*)) {
  HeldBuffer* buffer = TakeBuffer(ImplAddress(t));
  if (!buffer) return false;
  if (keep(entry, buffer)) return true;
  DropBuffer(buffer);
  return false;
}

// Lets `entry`'s donor go if nothing but the entry refers to it (no other
// Python reference, no C++ owner of its TensorImpl) and its buffer can be
// read natively: the entry keeps only its buffer (lazy_reads.h HeldBuffer).
// True when released.
bool ReleaseIfUnheld(PyObject* entry, PyObject* t) {
  if (t == Py_None || Py_REFCNT(t) != 1 || !LazyReadsEnabled()) return false;
  TensorFacts facts;
  const int read = Facts(t, &facts, /*with_sizes=*/false);
  Check(read >= 0);
  return read == 1 && facts.impl_use_count == 1 && KeepBuffer(entry, t, ReleaseEntryTensor);
}

// Keeps a poisoned donor the user still holds only weakly (py_types.h
// WeakenEntryTensor): its verdict reads the buffer, which the entry takes,
// so the tensor dies when the loop drops it, as raw donation's do, rather
// than with the entry at the next barrier, whose release would free it
// just before the execution is dispatched.  False, the entry keeping the
// tensor, when its buffer cannot be read natively.
bool WeakenHeld(PyObject* entry, PyObject* t) {
  return LazyReadsEnabled() && KeepBuffer(entry, t, WeakenEntryTensor);
}

// Before the real execution, with the flags armed: lets go of every donor
// nothing but its entry refers to (the loop rebound its name), so that
// torch_xla's barrier does not walk, and its graph does not keep, tensors
// nobody can read; it takes the armed buffers from the pending IR that
// reads them.  Returns how many were released.
size_t ReleaseUnheld(py::list donors) {
  RequireBound();
  size_t released = 0;
  for (size_t i = 0, n = donors.size(); i < n; ++i) {
    PyObject* entry = PyList_GET_ITEM(donors.ptr(), i);
    const RecordPtr* rec;
    released += ReleaseIfUnheld(entry, TensorOf(entry, &rec));
    EntryLetGoOfDead(entry);
  }
  return released;
}

// After the real execution has built its graph: poison each donor the user
// still holds.  No verdict yet, even for a buffer that reads as deleted
// already: while the step is being dispatched, XLA holds a donated buffer in
// a way that reads as deleted, and gives it back if the step then fails.
// Only a deletion seen once the step was dispatched is certain (verdicts.py).
//
// A donor that nothing but its entry refers to (no other Python reference,
// no C++ owner of its TensorImpl) is not poisoned: no code can put it into
// another graph.  With `release` it is let go right here: the entry keeps
// only its buffer (the one thing its verdict reads, lazy_reads.h) and the
// Python tensor, its functional wrapper and the XLATensor die now, as raw
// donation's die while tracing, rather than with the entry at the next
// barrier.  Weak references do not keep it: it dies as it is let go.
// Without `release`, or when its buffer cannot be read natively, the entry
// keeps it.  A donor the user still holds is poisoned and, with `release`,
// kept only weakly from then on (WeakenHeld).
//
// The donor flag: the graph's donor set is fixed, so it is cleared now on a
// donor the entry keeps, and left armed on a buffer the entry's record keeps
// (released or weakened): nothing can put that buffer into a graph but a
// use of its poisoned tensor, which settles the verdict first, and the
// verdict clears the flag of a buffer it gives back (verdicts.py `_keep`);
// every later execution's commit clears it too, before its graph is built,
// if the buffer still holds a value and the user still holds its tensor
// (`live_held(reachable=True)`, `disarm_held`).  A consumed buffer's flag can
// arm nothing, and a buffer no tensor leads to any more (released, or its
// weakened tensor died) is in no graph, so the typical loop costs no
// torch_xla call here at all, whether it rebinds its names or holds the old
// tensors, and whether or not the step before has run yet.
//
// Never stops half-way: a donor whose poisoning fails (a tensor subclass
// that changed its class since marking, say) is returned with the error's
// text, after every other donor was handled; the caller reports it once the
// commit is whole.  Returns a list of (entry, message).
py::list DisarmAndPoison(py::list donors, bool release) {
  RequireBound();
  py::list failed;
  PrefetchEntryTensors(donors.ptr());
  for (size_t i = 0, n = donors.size(); i < n; ++i) {
    PyObject* entry = PyList_GET_ITEM(donors.ptr(), i);
    const RecordPtr* rec;
    PyObject* t = TensorOf(entry, &rec);
    if (t == Py_None) continue;  // released by an earlier commit's call
    if (release && ReleaseIfUnheld(entry, t)) continue;
    int unreachable = OnlyHeldByItsEntry(t);
    Check(unreachable >= 0);
    if (unreachable) continue;
    // Weakened (and its flag left armed) or disarmed before it is poisoned:
    // torch_xla's call on a poisoned tensor would be a use of it.
    py::object keep = py::reinterpret_borrow<py::object>(t);  // the entry's goes if weakened
    const bool weakened = release && WeakenHeld(entry, t);
    if (!weakened && SetDonor(t, false) < 0) PyErr_Clear();
    if (Poison(t, *rec) != 0) {
      py::error_already_set error;  // takes the Python error
      failed.append(py::make_tuple(py::handle(entry), py::str(error.what())));
    }
  }
  return failed;
}

// The buffer the record of `item` (an entry, or a record) keeps for its
// donor, released or weakened by a commit, if it still holds a value; else
// null.
const HeldBuffer* LiveHeldBuffer(PyObject* item) {
  PyObject* t;
  const RecordPtr* rec;
  if (!EntryParts(item, &t, &rec)) rec = &RecordArg(item);  // a record itself
  const auto* buffer = static_cast<const HeldBuffer*>((*rec)->held.get());
  return buffer && !HeldBufferConsumed(buffer) ? buffer : nullptr;
}

// live_held(items, reachable=False) -> [item]: the entries or records whose
// record keeps a buffer (its donor released or weakened by a commit) that
// still holds a value: a donation not consumed, or not yet, whose flag
// `finish` left armed.  With `reachable`, only the entries whose tensor
// still leads to that buffer (EntryTensorAlive): a weakened donor the user
// still holds.  Reads only the buffers: nothing when every one was
// consumed, or none is reachable.
py::list LiveHeld(py::list items, bool reachable) {
  py::list live;
  PrefetchEntries(items.ptr());
  for (size_t i = 0, n = items.size(); i < n; ++i) {
    PyObject* item = PyList_GET_ITEM(items.ptr(), i);
    if (reachable && !EntryTensorAlive(item)) continue;
    if (LiveHeldBuffer(item)) Check(PyList_Append(live.ptr(), item) == 0);
  }
  return live;
}

// disarm_held(items, carrier, set_donation): clears the donor flag of the
// buffer each item's record keeps, if it still holds a value, through the
// XLA tensor `carrier` (lazy_reads.h SetHeldBufferDonation): no tensor of
// the user's is touched.
void DisarmHeld(py::list items, py::object carrier, py::object set_donation) {
  RequireBound();
  for (size_t i = 0, n = items.size(); i < n; ++i) {
    const HeldBuffer* buffer = LiveHeldBuffer(PyList_GET_ITEM(items.ptr(), i));
    if (buffer && SetHeldBufferDonation(buffer, carrier.ptr(), set_donation.ptr(), false) < 0)
      PyErr_Clear();
  }
}

// entry_consumed(entry) -> bool: whether the buffer of a released entry
// (its tensor None) holds no value any more; None for an entry that holds
// its tensor (ask about the tensor).
py::object EntryConsumed(py::handle entry) {
  const HeldBuffer* buffer = EntryBuffer(entry.ptr());
  if (!buffer) return py::none();
  return py::bool_(HeldBufferConsumed(buffer));
}

// Settles in-flight entries: a deleted buffer is CONSUMED; a live one is
// unused only if `certain` that its step was dispatched.  Entries settled
// meanwhile (by a use of the tensor) are skipped.  Returns (still unknown,
// unused); the caller un-poisons and warns about the unused ones.
py::tuple SettleEntries(py::list entries, bool certain) {
  RequireBound();
  py::list unknown, unused;
  PrefetchEntries(entries.ptr());
  // Settled together, also when a read raises; the thread's scratch
  // (base/scratch.h).
  Scratch<Record*> reused;
  struct SettleReused {
    std::vector<Record*>* records;
    ~SettleReused() { GlobalLedger().SettleAll(*records, Verdict::kReused); }
  };
  ReapBatch batch;  // the consumed buffers the verdicts let go: one handover
  {
    SettleReused settle{reused.get()};
    for (size_t i = 0, n = entries.size(); i < n; ++i) {
      PyObject* entry = PyList_GET_ITEM(entries.ptr(), i);
      const RecordPtr* rec;
      PyObject* t = TensorOf(entry, &rec);
      const RecordPtr& record = *rec;
      if (record->verdict != Verdict::kInFlight) continue;
      const HeldBuffer* buffer = EntryBuffer(entry);
      int deleted = buffer ? HeldBufferConsumed(buffer) : BufferDeleted(t);
      Check(deleted >= 0);
      if (deleted) {
        reused->push_back(record.get());
      } else {
        Check(PyList_Append((certain ? unused : unknown).ptr(), entry) == 0);
      }
    }
  }
  batch.Close();
  ReapHandOver();  // the consumed buffers settled here, freed off this thread
  return py::make_tuple(unknown, unused);
}

}  // namespace

void RegisterCommit(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  m.def("split_committed", &SplitCommitted, py::arg("tensors"), py::arg("records"),
        py::arg("pending"));
  m.def("pending_flags", &PendingFlagsOf, py::arg("tensors"));
  m.def("arm", &Arm, py::arg("donors"));
  m.def("disarm", &Disarm, py::arg("entries"));
  m.def("release_unheld", &ReleaseUnheld, py::arg("donors"));
  m.def("disarm_and_poison", &DisarmAndPoison, py::arg("donors"), py::arg("release") = false);
  m.def("entry_consumed", &EntryConsumed, py::arg("entry"));
  m.def("live_held", &LiveHeld, py::arg("items"), py::arg("reachable") = false);
  m.def("disarm_held", &DisarmHeld, py::arg("items"), py::arg("carrier"), py::arg("set_donation"));
  m.def("settle_entries", &SettleEntries, py::arg("entries"), py::arg("certain"));
}

}  // namespace torch_xla_donate
