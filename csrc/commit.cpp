// The commit of a step's marks: begin and split (Split_, Screen), then the poisoning (Finish) and
// the verdicts' reads (SettleEntries); Python arms, disarms and words outcomes (_commit.py).
#include <pybind11/stl.h>

#include "reads.h"

namespace torch_xla_donate {
namespace {

PyObject* TensorOf(PyObject* entry, const RecordPtr** record) {
  PyObject* t;
  const RecordPtr* ignored;
  if (!EntryParts(entry, &t, record ? record : &ignored))
    throw py::type_error("expected (tensor, record) entries");
  return t;
}

// The donors, and the entries referred back to Python as (entry, Split, detail).
struct Judged {
  std::vector<PyObject*> donors;  // borrowed: the caller keeps the entries alive
  py::list referred;
  void Refer(PyObject* entry, Split split, py::object detail) {
    Check(PyList_Append(referred.ptr(),
                        py::make_tuple(py::handle(entry), static_cast<int>(split), detail).ptr()) ==
          0);
  }
  void Donor(PyObject* entry) { donors.push_back(entry); }
  py::list DonorList() const {  // one block, not a list grown per donor
    py::list out(donors.size());
    for (size_t i = 0; i < donors.size(); ++i) PyList_SET_ITEM(out.ptr(), i, Py_NewRef(donors[i]));
    return out;
  }
};

// The buffer checks of read candidates: copies made in the step (the registry's walk; without
// functionalization, whose holder counts are unread, also tensors holding the buffer), then counts.
void Screen(const std::vector<PyObject*>& entries, std::vector<LazyFacts>& facts,
            const std::vector<int64_t>& clones, Judged* out) {
  const size_t n = entries.size();
  if (n == 0) return;
  std::vector<DonorKey> keys(n);
  std::vector<char> read(n);
  for (size_t i = 0; i < n; ++i) {
    read[i] = facts[i].tensor_id >= 0 && DonorKeyOfFacts(facts[i], &keys[i]);
    keys[i].match_handle = !(facts[i].is_functional && facts[i].has_handle);
  }
  std::vector<std::vector<int64_t>> copies;
  bool walked;
  {
    py::gil_scoped_release no_gil;
    walked = SameStepCopies(keys, clones, &copies);
  }
  if (!walked) throw std::runtime_error("torch_xla's live-tensor registry cannot be walked");
  std::vector<size_t> counted;
  std::vector<LazyFacts> counted_facts;
  counted.reserve(n);
  counted_facts.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!read[i])
      out->Refer(entries[i], Split::UNREAD, py::none());
    else if (!copies[i].empty())
      out->Refer(entries[i], Split::COPY, py::cast(copies[i]));
    else if (!keys[i].match_handle) {
      counted.push_back(i);
      counted_facts.push_back(facts[i]);
    } else
      out->Donor(entries[i]);
  }
  const std::vector<long> extra = ExcessHolders(counted_facts);
  for (size_t k = 0; k < counted.size(); ++k) {
    if (extra[k] > 0)
      out->Refer(entries[counted[k]], Split::EXCESS, py::int_(extra[k]));
    else
      out->Donor(entries[counted[k]]);
  }
}

// commit(only=None) -> (step, donors, referred): takes the marks (all, or `only`'s) into a new step
// and splits them: not XLA: DROPPED; pending or version moved: UPDATED_IN_PLACE; views, aliases or
// autograd: HELD (for Python to judge); then Screen.  The rest are donors, not armed yet.
py::tuple Split_(py::object only) {
  RequireBound();
  std::vector<PyObject*> keys;
  if (!only.is_none()) keys.reserve(py::len(only));
  if (!only.is_none())
    for (auto t : only) keys.push_back(t.ptr());
  Scratch<py::object> tensors_scratch;  // before the records: let go of last
  Scratch<RecordPtr> records_scratch;
  std::vector<py::object>& tensors = *tensors_scratch;
  std::vector<RecordPtr>& records = *records_scratch;
  const int64_t step =
      GlobalLedger().BeginStep(&tensors, &records, only.is_none() ? nullptr : &keys);
  Judged judged;
  std::vector<py::object> entries;  // keeps the candidates' entries alive
  std::vector<PyObject*> candidates;
  std::vector<LazyFacts> facts;
  entries.reserve(tensors.size());
  judged.donors.reserve(tensors.size());
  candidates.reserve(tensors.size());
  facts.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    PyObject* t = tensors[i].ptr();
    Record* record = records[i].get();
    TensorFacts tf;
    if (Facts(t, &tf, false) != 1 || !tf.is_xla) {
      GlobalLedger().Settle(record, Verdict::DROPPED);
      continue;
    }
    LazyFacts lazy;
    const bool read = ReadLazy(t, &lazy);
    if ((record->version >= 0 && tf.version != record->version) || !read || lazy.pending) {
      GlobalLedger().Settle(record, Verdict::UPDATED_IN_PLACE);
      continue;
    }
    PyObject* entry = NewEntry(t, records[i]);
    Check(entry != nullptr);
    entries.push_back(py::reinterpret_steal<py::object>(entry));
    if (tf.storage_use_count > 1 || HeldByAutograd(t, tf)) {
      judged.Refer(entry, Split::HELD, py::none());
    } else {
      candidates.push_back(entry);
      facts.push_back(lazy);
    }
  }
  Screen(candidates, facts, {}, &judged);
  return py::make_tuple(step, judged.DonorList(), judged.referred);
}

// screen(entries, clones=()) -> (donors, referred): the buffer checks alone, for the entries
// Python let through (holders judged, waited for, or same-step copies that are `clones`).
py::tuple ScreenOf(py::list entries, std::vector<int64_t> clones) {
  RequireBound();
  std::vector<PyObject*> items;
  std::vector<LazyFacts> facts;
  for (py::handle entry : entries) {
    items.push_back(entry.ptr());
    facts.emplace_back();
    if (!ReadLazy(TensorOf(entry.ptr(), nullptr), &facts.back())) facts.back() = LazyFacts();
  }
  Judged judged;
  Screen(items, facts, clones, &judged);
  return py::make_tuple(judged.DonorList(), judged.referred);
}

// Hands `t`'s buffer to `entry` through `keep`; false, nothing changed, if it cannot.
bool KeepBuffer(PyObject* entry, PyObject* t, bool (*keep)(PyObject*, HeldBuffer*)) {
  HeldBuffer buffer = LazyReadsEnabled() ? TakeBuffer(ImplAddress(t)) : nullptr;
  return buffer && keep(entry, &buffer);
}

// Lets go of a donor only its entry refers to (a weak reference does not keep it): the entry
// keeps its buffer, and the tensor, its wrapper and the XLATensor die now, as raw donation's do.
bool ReleaseIfUnheld(PyObject* entry, PyObject* t) {
  // Not a tensor whose finalizer may bring it back: that one is poisoned.
  if (t == Py_None || Py_REFCNT(t) != 1 || Py_TYPE(t)->tp_finalize || Py_TYPE(t)->tp_del)
    return false;
  TensorFacts facts;
  return Facts(t, &facts, false) == 1 && facts.impl_use_count == 1 &&
         KeepBuffer(entry, t, ReleaseEntryTensor);
}

// release_unheld(donors): before the execution, with the flags armed.
size_t ReleaseUnheld(py::list donors) {
  RequireBound();
  size_t released = 0;
  for (py::handle entry : donors) {
    released += ReleaseIfUnheld(entry.ptr(), TensorOf(entry.ptr(), nullptr));
    EntryLetGoOfDead(entry.ptr());
  }
  return released;
}

// finish(donors, release) -> (to_disarm, failed): poisons each donor the user holds.  An unheld one
// is let go (`release`) or left; a held one, with `release`, kept weakly, its flag left armed on
// its record's buffer (only a use of its poisoned tensor can put that buffer into a graph, and the
// use settles the verdict first); the others come back to disarm.  failed: (entry, message).
py::tuple Finish(py::list donors, bool release) {
  RequireBound();
  py::list failed, to_disarm;
  for (py::handle item : donors) {
    PyObject* entry = item.ptr();
    const RecordPtr* record;
    PyObject* t = TensorOf(entry, &record);
    if (t == Py_None) continue;  // released by an earlier call
    if (release && ReleaseIfUnheld(entry, t)) continue;
    if (OnlyHeldByItsEntry(t)) continue;
    py::object keep = py::reinterpret_borrow<py::object>(t);  // the entry's goes if weakened
    if (!(release && KeepBuffer(entry, t, WeakenEntryTensor)))
      Check(PyList_Append(to_disarm.ptr(), t) == 0);
    if (Poison(t, *record) != 0) {
      py::error_already_set error;
      failed.append(py::make_tuple(item, py::str(error.what())));
    }
  }
  return py::make_tuple(to_disarm, failed);
}

// settle_entries(entries, certain) -> (unknown, unused): a deleted buffer is REUSED; a live one
// unused only when `certain` its step was dispatched.  Entries settled meanwhile are skipped.
py::tuple SettleEntries(py::list entries, bool certain) {
  RequireBound();
  py::list unknown, unused;
  Scratch<Record*> scratch;
  std::vector<Record*>& reused = *scratch;
  struct SettleReused {  // also when a read raises
    std::vector<Record*>* records;
    ~SettleReused() { GlobalLedger().SettleAll(*records, Verdict::REUSED); }
  } settle{&reused};
  for (py::handle entry : entries) {
    const RecordPtr* record;
    PyObject* t = TensorOf(entry.ptr(), &record);
    if ((*record)->verdict != Verdict::IN_FLIGHT) continue;
    const HeldBuffer* buffer = EntryBuffer(entry.ptr());
    const int deleted = buffer ? HeldBufferConsumed(*buffer) : BufferDeleted(t);
    Check(deleted >= 0);
    if (deleted)
      reused.push_back(record->get());
    else
      Check(PyList_Append((certain ? unused : unknown).ptr(), entry.ptr()) == 0);
  }
  return py::make_tuple(unknown, unused);
}

}  // namespace

void RegisterCommit(py::module_& m) {
  m.def("commit", &Split_, py::arg("only") = py::none());
  m.def("screen", &ScreenOf, py::arg("entries"), py::arg("clones") = std::vector<int64_t>());
  m.def("release_unheld", &ReleaseUnheld, py::arg("donors"));
  m.def("finish", &Finish, py::arg("donors"), py::arg("release") = false);
  m.def("settle_entries", &SettleEntries, py::arg("entries"), py::arg("certain"));
  m.def(
      "live_held",
      [](py::list items, bool reachable) {
        // Entries (or records) keeping a buffer that holds a value, its flag left armed by
        // finish; with `reachable`, only those whose tensor leads to it (a weakened donor held).
        py::list live;
        for (py::handle item : items) {
          PyObject* t;
          const RecordPtr* record;
          if (!EntryParts(item.ptr(), &t, &record)) record = &RecordArg(item.ptr());
          const HeldBuffer& buffer = (*record)->held;
          if (reachable && !EntryTensorAlive(item.ptr())) continue;
          if (buffer && !HeldBufferConsumed(buffer)) live.append(item);
        }
        return live;
      },
      py::arg("items"), py::arg("reachable") = false);
  m.def(
      "entry_consumed",
      [](py::handle entry) -> py::object {
        const HeldBuffer* buffer = EntryBuffer(entry.ptr());
        return buffer ? py::bool_(HeldBufferConsumed(*buffer)) : py::object(py::none());
      },
      py::arg("entry"), "Whether a released entry's buffer holds no value; None: ask the tensor.");
}

}  // namespace torch_xla_donate
