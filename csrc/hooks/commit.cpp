// See commit.h.
#include "hooks/commit.h"

#include <pybind11/pybind11.h>

#include <algorithm>
#include <stdexcept>
#include <unordered_map>
#include <vector>

#include "base/ledger.h"
#include "base/py_types.h"
#include "base/scratch.h"
#include "base/tensor_access.h"
#include "base/tensor_facts.h"
#include "lazy/live_tensors.h"
#include "lazy/reaper.h"
#include "outcomes/poison.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

PyObject* TensorOf(PyObject* entry, const RecordPtr** record) {
  PyObject* t;
  const RecordPtr* ignored;
  if (!EntryParts(entry, &t, record ? record : &ignored))
    throw py::type_error("expected (tensor, record) entries");
  return t;
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

// A step's marks, judged: the donors, and the others with their Split and
// what it found (the extra holders, or the ids of the live tensors that
// read the buffer).  Judge is the one home of the commit's rules.
struct Judged {
  py::list donors, undecided;
  void Refer(PyObject* entry, Split code, py::object detail) {
    Check(PyList_Append(undecided.ptr(),
                        py::make_tuple(py::handle(entry), static_cast<int>(code), detail).ptr()) ==
          0);
  }
};

// The buffer checks of `entries` (Entry objects whose tensors are donor
// candidates: XLA, materialized, no alias or autograd holder): the walk of
// live tensors for copies made in the step (live_tensors.h; without
// functionalization also for tensors holding the buffer itself, whose
// holder counts cannot be read) and the buffers' holder counts.
void Screen(const std::vector<PyObject*>& entries, Judged* out) {
  const size_t n = entries.size();
  if (n == 0) return;
  Scratch<LazyFacts> facts_of;
  Scratch<DonorKey> keys_of;
  std::vector<LazyFacts>& facts = *facts_of;
  std::vector<DonorKey>& keys = *keys_of;
  facts.resize(n);
  keys.resize(n);
  std::vector<char> read(n, 0);
  for (size_t i = 0; i < n; ++i) {
    PyObject* t = TensorOf(entries[i], nullptr);
    read[i] = ReadLazy(t, &facts[i]) && DonorKeyOfFacts(facts[i], &keys[i]);
    // Holder counts read only with a handle and functionalization: else the
    // walk also looks for live tensors holding the buffer itself.
    keys[i].match_handle = !(facts[i].is_functional && facts[i].has_handle);
  }
  Scratch<std::vector<int64_t>> copies;
  bool walked;
  {
    py::gil_scoped_release no_gil;
    walked = SameStepCopies(keys, copies.get());
  }
  if (!walked) throw std::runtime_error("torch_xla's live-tensor registry cannot be walked");
  // Holder counts of the functional donors left (the others have none).
  std::vector<size_t> counted;
  std::vector<LazyFacts> counted_facts;
  for (size_t i = 0; i < n; ++i) {
    if (!read[i]) {
      out->Refer(entries[i], Split::kUnread, py::none());
    } else if (!(*copies)[i].empty()) {
      py::list ids;
      for (int64_t id : (*copies)[i]) ids.append(id);
      out->Refer(entries[i], Split::kCopy, std::move(ids));
    } else if (!keys[i].match_handle) {
      counted.push_back(i);
      counted_facts.push_back(facts[i]);
    } else {
      Check(PyList_Append(out->donors.ptr(), entries[i]) == 0);
    }
  }
  const std::vector<long> extra = ExcessHolders(counted_facts);
  for (size_t k = 0; k < counted.size(); ++k) {
    PyObject* entry = entries[counted[k]];
    if (extra[k] > 0)
      out->Refer(entry, Split::kExcess, py::int_(extra[k]));
    else
      Check(PyList_Append(out->donors.ptr(), entry) == 0);
  }
}

// commit(only=None) -> (step, donors, undecided)
//
// Takes every mark (or those of the tensors in `only`: a compiled call's
// arguments) into a new step and judges each, the rules in this order:
//  * no XLA tensor (junk put straight into the ledger): DROPPED, quietly;
//  * pending, or its version counter moved: updated in place after marking,
//    an output, no donor: UPDATED_IN_PLACE;
//  * views or aliases alive, or held by autograd: kHeld, for Python to
//    judge (holders.py);
//  * then the buffer checks (Screen): kCopy, kExcess, kUnread;
//  * the rest are donors (entries), not armed yet.
// `undecided` lists (entry, Split, detail).
py::tuple Commit(py::object only) {
  RequireBound();
  std::vector<PyObject*> keys;
  if (!only.is_none())
    for (auto t : only) keys.push_back(t.ptr());
  Scratch<py::object> owned;  // before the records: let go of last
  Scratch<RecordPtr> recs;
  const int64_t step =
      GlobalLedger().BeginStep(owned.get(), recs.get(), only.is_none() ? nullptr : &keys);
  const size_t n = owned->size();
  PrefetchTensors(reinterpret_cast<PyObject* const*>(owned->data()), static_cast<Py_ssize_t>(n));
  Judged judged;
  py::list entries;  // keeps the candidates' entries alive while Screen reads them
  std::vector<PyObject*> candidates;
  for (size_t i = 0; i < n; ++i) {
    PyObject* t = (*owned)[i].ptr();
    const RecordPtr& record = (*recs)[i];
    TensorFacts facts;
    if (Facts(t, &facts, /*with_sizes=*/false) != 1 || !facts.is_xla) {
      GlobalLedger().Settle(record, Verdict::kDropped);
      continue;
    }
    if (record->UpdatedSinceMarking(facts.version) || HasPendingIr(t) != 0) {
      GlobalLedger().Settle(record, Verdict::kUpdatedInPlace);
      continue;
    }
    PyObject* entry = NewEntry(t, record);
    Check(entry != nullptr);
    Check(PyList_Append(entries.ptr(), entry) == 0);
    Py_DECREF(entry);
    const int by_autograd = HeldByAutograd(t, facts);
    Check(by_autograd >= 0);
    if (facts.storage_use_count > 1 || by_autograd)
      judged.Refer(entry, Split::kHeld, py::none());
    else
      candidates.push_back(entry);
  }
  Screen(candidates, &judged);
  return py::make_tuple(step, judged.donors, judged.undecided);
}

// screen(entries) -> (donors, undecided): Screen alone, for entries Python
// let through after judging their holders or waiting for a moment's ones.
py::tuple ScreenOf(py::list entries) {
  RequireBound();
  std::vector<PyObject*> items;
  for (size_t i = 0, n = entries.size(); i < n; ++i)
    items.push_back(PyList_GET_ITEM(entries.ptr(), i));
  Judged judged;
  Screen(items, &judged);
  return py::make_tuple(judged.donors, judged.undecided);
}

}  // namespace

std::vector<long> ExcessHolders(const std::vector<LazyFacts>& facts) {
  const size_t n = facts.size();
  std::vector<long> extra(n, 0);
  bool clean = true;
  for (const LazyFacts& f : facts) clean = clean && f.only_own_holders();
  if (clean) return extra;
  std::unordered_map<uintptr_t, std::vector<size_t>> groups;
  for (size_t i = 0; i < n; ++i)
    if (facts[i].has_value) groups[facts[i].buffer].push_back(i);
  for (size_t i = 0; i < n; ++i) {
    std::vector<size_t> alone{i};
    const std::vector<size_t>& members = facts[i].has_value ? groups[facts[i].buffer] : alone;
    if (members.front() != i) continue;  // judged with the group's first member
    long allowed = 0, refs = 0;
    for (size_t m : members) {
      allowed += facts[m].expected_holders;
      refs = std::max(refs, facts[m].xla_tensor_refcount);
    }
    const long over =
        std::max(facts[i].buffer_use_count - allowed, refs - static_cast<long>(members.size()));
    if (over > 0)
      for (size_t m : members) extra[m] = over;
  }
  return extra;
}

namespace {

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
py::tuple Finish(py::list donors, bool release) {
  RequireBound();
  py::list failed, to_disarm;
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
    // Weakened (its flag left armed), or handed back for Python to disarm:
    // torch_xla's call reads past the poison, which the dispatcher keeps.
    py::object keep = py::reinterpret_borrow<py::object>(t);  // the entry's goes if weakened
    const bool weakened = release && WeakenHeld(entry, t);
    if (!weakened) Check(PyList_Append(to_disarm.ptr(), t) == 0);
    if (Poison(t, *rec) != 0) {
      py::error_already_set error;  // takes the Python error
      failed.append(py::make_tuple(py::handle(entry), py::str(error.what())));
    }
  }
  return py::make_tuple(to_disarm, failed);
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
  py::list members;
  for (const char* name : {"DONOR", "HELD", "COPY", "EXCESS", "UNREAD"})
    members.append(py::make_tuple(name, members.size()));
  m.attr("Split") = py::module_::import("enum").attr("IntEnum")(
      "Split", members, py::arg("module") = "torch_xla_donate._C");
  m.def("commit", &Commit, py::arg("only") = py::none());
  m.def("screen", &ScreenOf, py::arg("entries"));
  m.def("release_unheld", &ReleaseUnheld, py::arg("donors"));
  m.def("finish", &Finish, py::arg("donors"), py::arg("release") = false);
  m.def("entry_consumed", &EntryConsumed, py::arg("entry"));
  m.def("live_held", &LiveHeld, py::arg("items"), py::arg("reachable") = false);
  m.def("settle_entries", &SettleEntries, py::arg("entries"), py::arg("certain"));
}

}  // namespace torch_xla_donate
