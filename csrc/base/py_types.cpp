// See py_types.h.
#include "base/py_types.h"

#include <pybind11/pybind11.h>

#include <cctype>
#include <new>
#include <string>

#include "base/prefetch.h"
#include "base/ptr_index.h"
#include "base/variable.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

// The members of the Python IntEnum `_C.Verdict`, by value.  An IntEnum
// compares as an int, so `record.verdict != Verdict.IN_FLIGHT` is cheap.
PyObject* g_verdicts[kVerdictCount] = {};

// -- Record -------------------------------------------------------------------

struct PyRecord {
  PyObject_HEAD RecordPtr record;
};

PyTypeObject* g_record_type = nullptr;

const Record& R(PyObject* self) { return *reinterpret_cast<PyRecord*>(self)->record; }

void RecordDealloc(PyObject* self) {
  reinterpret_cast<PyRecord*>(self)->record.~RecordPtr();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);  // instances of a heap type own a reference to it
}

PyObject* Str(const std::string& s) {
  return PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
}

PyObject* RecordRepr(PyObject* self) {
  const Record& r = R(self);
  return Str("<donation #" + std::to_string(r.id) + " " + r.ShapeString() + " at " + r.Where() +
             " step=" + std::to_string(r.step) + " " + VerdictName(r.verdict) + ">");
}

PyObject* GetId(PyObject* self, void*) { return PyLong_FromLongLong(R(self).id); }
PyObject* GetStep(PyObject* self, void*) { return PyLong_FromLongLong(R(self).step); }
PyObject* GetFile(PyObject* self, void*) { return Str(*R(self).file); }
PyObject* GetLine(PyObject* self, void*) { return PyLong_FromLong(R(self).line); }
PyObject* GetDtype(PyObject* self, void*) { return Str(*R(self).dtype); }
PyObject* GetNbytes(PyObject* self, void*) { return PyLong_FromLongLong(R(self).nbytes); }
PyObject* GetVerdict(PyObject* self, void*) { return VerdictObject(R(self).verdict); }
PyObject* GetShapeString(PyObject* self, void*) { return Str(R(self).ShapeString()); }
PyObject* GetWhere(PyObject* self, void*) { return Str(R(self).Where()); }
PyObject* GetVia(PyObject* self, void*) { return PyUnicode_FromString(ViaName(R(self).via)); }
PyObject* GetVersion(PyObject* self, void*) { return PyLong_FromLongLong(R(self).version); }

PyObject* GetShape(PyObject* self, void*) {
  const auto& shape = R(self).shape;
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(shape.size()));
  if (!t) return nullptr;
  for (size_t i = 0; i < shape.size(); ++i) {
    PyObject* d = PyLong_FromLongLong(shape[i]);
    if (!d) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), d);
  }
  return t;
}

PyGetSetDef kRecordGetters[] = {
    {"id", GetId, nullptr, "Unique number of this donation.", nullptr},
    {"step", GetStep, nullptr, "The execution that committed it (-1: not yet).", nullptr},
    {"file", GetFile, nullptr, "File of the call that marked it.", nullptr},
    {"line", GetLine, nullptr, "Line of the call that marked it.", nullptr},
    {"shape", GetShape, nullptr, "Shape of the donated tensor.", nullptr},
    {"dtype", GetDtype, nullptr, "XLA-style dtype name (f32, bf16, s64, ...).", nullptr},
    {"nbytes", GetNbytes, nullptr, "Size of the donated buffer in bytes.", nullptr},
    {"verdict", GetVerdict, nullptr, "What became of the donation (Verdict).", nullptr},
    {"shape_string", GetShapeString, nullptr, "e.g. 'f32[4,4]'.", nullptr},
    {"where", GetWhere, nullptr, "'file:line' of the call that marked it.", nullptr},
    {"via", GetVia, nullptr, "The call that marked it: 'donate_buffer()', 'donate()', ...",
     nullptr},
    {"version", GetVersion, nullptr, "The tensor's version counter when marked (-1: none).",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

PyType_Slot kRecordSlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(RecordDealloc)},
    {Py_tp_repr, reinterpret_cast<void*>(RecordRepr)},
    {Py_tp_getset, kRecordGetters},
    {Py_tp_doc, const_cast<char*>("One donation: where it was made, of what, and its verdict.")},
    {0, nullptr},
};

PyType_Spec kRecordSpec = {
    "torch_xla_donate._C.Record",
    sizeof(PyRecord),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    kRecordSlots,
};

// -- Entry --------------------------------------------------------------------
//
// A tuple would do, but a tuple that holds a tensor is tracked by Python's
// garbage collector, and a step with 10,000 donations keeps 10,000 of them
// alive until the next barrier: they reach the oldest generation and make
// full collections (which walk every object of the program) run several
// times more often.  An Entry is not tracked.  It cannot close a reference
// cycle: nothing refers back to it (a poisoned tensor refers to its record,
// never to its entry).  It unpacks and indexes like the pair it stands for.
//
// Released at the commit (hooks/commit.cpp): a donor nobody else refers to
// gives up its tensor (then None) and keeps only its buffer, which is all a
// verdict reads, so the Python tensor, its functional wrapper and the
// XLATensor die at the commit, as raw donation's die while tracing, instead
// of at the next barrier (where torch_xla's walk over the live tensors
// would meet them first).
//
// Weakened at the commit: a poisoned donor the user still holds is kept
// through a weak reference and its buffer.  It dies when the loop drops it,
// as raw donation's do (its poisoned class's finalizer lets go of the weak
// reference, WeakenedTensorDying: a weak count keeps the TensorImpl's
// memory, and a functional wrapper's memory keeps torch_xla's tensor), and
// a verdict that leaves it its value (UNUSED, STEP_FAILED) still finds it
// to lift the poison while it lives: indexing or unpacking the entry gives
// the tensor, or None once it died.  Native code reading an entry in place
// (EntryParts) sees None: it reads the buffer.
//
// Either way the buffer rides on the record (Record::held), which lets it
// go when the verdict is in, or with the entry.

PyTypeObject* g_entry_type = nullptr;

struct PyEntry {
  PyObject_HEAD PyObject* tensor;  // None once released or weakened
  RecordPtr native;                // the record (placement-constructed: a C++ member)
  // Its Record object, made on the first ask from Python (indexing,
  // unpacking, repr): the native passes of a step read `native` only, and
  // the fast commit makes no Record object per donor.
  PyObject* record;
  uintptr_t weak;         // once weakened: the tensor, weakly (variable.h WeakTensorTake)
  bool buffer_on_record;  // released or weakened: Record::held is this entry's
};

Record& RecordOf(PyEntry* e) { return *e->native; }

// The entry's Record object (borrowed), made now if not yet; nullptr with a
// Python error.
PyObject* RecordObject(PyEntry* e) {
  if (e->record == nullptr) e->record = WrapRecord(e->native);
  return e->record;
}

// The weakened entries by their tensor's TensorImpl address (`weak`), for
// WeakenedTensorDying.  A key's memory cannot be reused while it is here:
// the entry's weak reference keeps it.  The GIL guards it.
PtrIndex g_weakened;

// Lets go of `e`'s weak reference to its tensor (which may live on).
void DropWeak(PyEntry* e) {
  const uintptr_t weak = e->weak;
  g_weakened.Erase(reinterpret_cast<const void*>(weak));
  e->weak = 0;
  WeakTensorDrop(weak);
}

// Hands `buffer` to the entry's record and lets go of the tensor, keeping
// it weakly if `weak`.  False (nothing changed) for no Entry, or one whose
// tensor is gone already.
bool KeepBufferOnRecord(PyObject* entry, HeldBuffer* buffer, uintptr_t weak) {
  if (Py_TYPE(entry) != g_entry_type) return false;
  auto* e = reinterpret_cast<PyEntry*>(entry);
  if (e->buffer_on_record) return false;
  RecordOf(e).held = {buffer, [](void* b) { DropBuffer(static_cast<HeldBuffer*>(b)); }};
  e->buffer_on_record = true;
  e->weak = weak;
  if (weak != 0) g_weakened.Set(reinterpret_cast<const void*>(weak), reinterpret_cast<size_t>(e));
  Py_INCREF(Py_None);
  Py_SETREF(e->tensor, Py_None);  // frees a released donor; a weakened one lives on
  return true;
}

void EntryDealloc(PyObject* self) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  if (e->buffer_on_record) RecordOf(e).held.reset();  // an open verdict reads the tensor's own
  if (e->weak != 0) DropWeak(e);
  Py_CLEAR(e->tensor);
  Py_CLEAR(e->record);
  e->native.~RecordPtr();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

Py_ssize_t EntryLength(PyObject*) { return 2; }

// The entry's tensor (a new reference): the weakened one while it lives.
PyObject* EntryTensorRef(PyEntry* e) {
  if (e->weak != 0) {
    PyObject* t = WeakTensorObject(e->weak);
    if (t != nullptr || PyErr_Occurred()) return t;
    Py_RETURN_NONE;  // the tensor died
  }
  Py_INCREF(e->tensor);
  return e->tensor;
}

PyObject* EntryItem(PyObject* self, Py_ssize_t i) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  if (i < 0 || i > 1) {
    PyErr_SetString(PyExc_IndexError, "an entry is (tensor, record)");
    return nullptr;
  }
  if (i == 0) return EntryTensorRef(e);
  PyObject* record = RecordObject(e);
  Py_XINCREF(record);
  return record;
}

// `t, record = entry` in Python: with only the sequence protocol, unpacking
// ends by raising and clearing an IndexError (about 600 instructions, once
// per donor wherever Python unpacks entries); a tuple's iterator ends
// without one.
PyObject* EntryIter(PyObject* self) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  PyObject* record = RecordObject(e);
  if (!record) return nullptr;
  PyObject* t = EntryTensorRef(e);
  if (!t) return nullptr;
  PyObject* pair = PyTuple_Pack(2, t, record);
  Py_DECREF(t);
  if (!pair) return nullptr;
  PyObject* it = PyObject_GetIter(pair);
  Py_DECREF(pair);
  return it;
}

PyObject* EntryRepr(PyObject* self) {
  PyObject* record = RecordObject(reinterpret_cast<PyEntry*>(self));
  return record ? PyUnicode_FromFormat("<entry %R>", record) : nullptr;
}

PyType_Slot kEntrySlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(EntryDealloc)},
    {Py_tp_repr, reinterpret_cast<void*>(EntryRepr)},
    {Py_sq_length, reinterpret_cast<void*>(EntryLength)},
    {Py_sq_item, reinterpret_cast<void*>(EntryItem)},
    {Py_tp_iter, reinterpret_cast<void*>(EntryIter)},
    {Py_tp_doc, const_cast<char*>("(tensor, record) of one donation, untracked by the GC.")},
    {0, nullptr},
};

PyType_Spec kEntrySpec = {
    "torch_xla_donate._C.Entry",
    sizeof(PyEntry),
    0,
    Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    kEntrySlots,
};

PyTypeObject* NewType(PyType_Spec* spec) {
  auto* type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(spec));
  if (!type) throw py::error_already_set();
  return type;
}

}  // namespace

PyObject* VerdictObject(Verdict v) {
  PyObject* o = g_verdicts[static_cast<int>(v)];
  Py_INCREF(o);
  return o;
}

PyObject* WrapRecord(RecordPtr record) {
  PyObject* o = g_record_type->tp_alloc(g_record_type, 0);
  if (!o) return nullptr;
  new (&reinterpret_cast<PyRecord*>(o)->record) RecordPtr(std::move(record));
  return o;
}

bool BeginStepLists(const std::vector<PyObject*>* only, int64_t* step, PyObject** tensors,
                    PyObject** records) {
  std::vector<py::object> owned;
  std::vector<RecordPtr> recs;
  *step = GlobalLedger().BeginStep(&owned, &recs, only);
  const Py_ssize_t n = static_cast<Py_ssize_t>(owned.size());
  *tensors = PyList_New(n);
  if (!*tensors) return false;
  for (Py_ssize_t i = 0; i < n; ++i) PyList_SET_ITEM(*tensors, i, owned[i].release().ptr());
  *records = RecordList(recs);
  if (!*records) Py_CLEAR(*tensors);
  return *records != nullptr;
}

PyObject* RecordList(const std::vector<RecordPtr>& records) {
  const Py_ssize_t n = static_cast<Py_ssize_t>(records.size());
  PyObject* list = PyList_New(n);
  for (Py_ssize_t i = 0; list && i < n; ++i) {
    PyObject* rec = WrapRecord(records[i]);
    if (!rec)
      Py_CLEAR(list);  // its empty slots are NULL, which its deallocation skips
    else
      PyList_SET_ITEM(list, i, rec);
  }
  return list;
}

bool IsRecord(PyObject* o) { return Py_TYPE(o) == g_record_type; }

const RecordPtr& Unwrap(PyObject* o) { return reinterpret_cast<PyRecord*>(o)->record; }

const RecordPtr& RecordArg(PyObject* o) {
  if (!IsRecord(o)) throw py::type_error("expected a torch_xla_donate._C.Record");
  return Unwrap(o);
}

PyObject* NewEntry(PyObject* tensor, PyObject* record) {
  PyObject* o = NewEntry(tensor, Unwrap(record));
  if (o) {
    Py_INCREF(record);
    reinterpret_cast<PyEntry*>(o)->record = record;
  }
  return o;
}

PyObject* NewEntry(PyObject* tensor, const RecordPtr& record) {
  PyObject* o = g_entry_type->tp_alloc(g_entry_type, 0);
  if (!o) return nullptr;
  auto* e = reinterpret_cast<PyEntry*>(o);
  Py_INCREF(tensor);
  e->tensor = tensor;
  new (&e->native) RecordPtr(record);
  e->record = nullptr;
  e->weak = 0;
  e->buffer_on_record = false;
  return o;
}

bool ReleaseEntryTensor(PyObject* entry, HeldBuffer* buffer) {
  return KeepBufferOnRecord(entry, buffer, /*weak=*/0);
}

bool WeakenEntryTensor(PyObject* entry, HeldBuffer* buffer) {
  if (Py_TYPE(entry) != g_entry_type) return false;
  PyObject* t = reinterpret_cast<PyEntry*>(entry)->tensor;
  if (t == Py_None) return false;
  // No Python weak reference: c10's weak count on the TensorImpl, which
  // makes no object for the collector to count (a Python one made every
  // held step of bench_async.py's 400 donors cross its threshold).
  const uintptr_t weak = WeakTensorTake(t);
  if (weak == 0) return false;  // kept
  if (KeepBufferOnRecord(entry, buffer, weak)) return true;
  WeakTensorDrop(weak);
  return false;
}

void EntryLetGoOfDead(PyObject* entry) {
  if (Py_TYPE(entry) != g_entry_type) return;
  auto* e = reinterpret_cast<PyEntry*>(entry);
  if (e->weak != 0 && !WeakTensorAlive(e->weak)) DropWeak(e);
}

void WeakenedTensorDying(uintptr_t impl) {
  const size_t* slot = g_weakened.Find(reinterpret_cast<const void*>(impl));
  if (slot != nullptr) DropWeak(reinterpret_cast<PyEntry*>(*slot));
}

const HeldBuffer* EntryBuffer(PyObject* entry) {
  if (Py_TYPE(entry) != g_entry_type) return nullptr;
  auto* e = reinterpret_cast<PyEntry*>(entry);
  // Null once the verdict is in: nothing reads a settled entry's buffer.
  return e->buffer_on_record ? static_cast<const HeldBuffer*>(RecordOf(e).held.get()) : nullptr;
}

bool EntryTensorAlive(PyObject* entry) {
  if (Py_TYPE(entry) != g_entry_type) return true;
  auto* e = reinterpret_cast<PyEntry*>(entry);
  if (!e->buffer_on_record) return true;
  return e->weak != 0 && WeakTensorAlive(e->weak);
}

void PrefetchEntries(PyObject* list) {
  const Py_ssize_t n = PyList_GET_SIZE(list);
  PyObject** items = PySequence_Fast_ITEMS(list);
  auto entry = [&](Py_ssize_t i) {
    PyObject* o = items[i];
    return Py_TYPE(o) == g_entry_type ? reinterpret_cast<PyEntry*>(o) : nullptr;
  };
  auto held = [&](Py_ssize_t i) -> const void* {
    PyEntry* e = entry(i);
    return e && e->buffer_on_record ? RecordOf(e).held.get() : nullptr;
  };
  // Level by level over the whole list: a level's first loads have arrived
  // by the time the next level reads them.
  for (Py_ssize_t i = 0; i < n; ++i) __builtin_prefetch(items[i]);
  for (Py_ssize_t i = 0; i < n; ++i)
    if (PyEntry* e = entry(i)) PrefetchBytes(e->native.get(), sizeof(Record));
  for (Py_ssize_t i = 0; i < n; ++i)
    if (const void* b = held(i)) __builtin_prefetch(b);
  for (Py_ssize_t i = 0; i < n; ++i)
    if (const void* b = held(i)) PrefetchHeldBuffer(static_cast<const HeldBuffer*>(b));
}

bool EntryParts(PyObject* o, PyObject** tensor, const RecordPtr** record) {
  if (Py_TYPE(o) == g_entry_type) {
    *tensor = reinterpret_cast<PyEntry*>(o)->tensor;
    *record = &reinterpret_cast<PyEntry*>(o)->native;
    return true;
  }
  if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 2 && IsRecord(PyTuple_GET_ITEM(o, 1))) {
    *tensor = PyTuple_GET_ITEM(o, 0);
    *record = &Unwrap(PyTuple_GET_ITEM(o, 1));
    return true;
  }
  return false;
}

void RegisterPyTypes(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  py::list members;
  for (int v = 0; v < kVerdictCount; ++v) {
    std::string name = VerdictName(static_cast<Verdict>(v));
    for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    members.append(py::make_tuple(name, v));
  }
  py::object verdict = py::module_::import("enum").attr("IntEnum")(
      "Verdict", members, py::arg("module") = "torch_xla_donate._C");
  verdict.attr("__doc__") =
      "What became of one donation; REUSED and LOST leave the tensor poisoned.";
  for (int v = 0; v < kVerdictCount; ++v) g_verdicts[v] = verdict(v).release().ptr();
  m.attr("Verdict") = verdict;

  // Which call marked a tensor, as the ledger's Via (messages name it).
  static const char* const kViaMembers[kViaCount] = {"DONATE_BUFFER", "DONATE", "DONATING",
                                                     "GRAPH_OP"};
  py::list vias;
  for (int v = 0; v < kViaCount; ++v) vias.append(py::make_tuple(kViaMembers[v], v));
  py::object via = py::module_::import("enum").attr("IntEnum")(
      "Via", vias, py::arg("module") = "torch_xla_donate._C");
  via.attr("__doc__") = "Which call marked a tensor (donate_buffer, donate, donating, a graph op).";
  m.attr("Via") = via;

  g_record_type = NewType(&kRecordSpec);
  m.attr("Record") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_record_type));
  g_entry_type = NewType(&kEntrySpec);
  m.attr("Entry") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_entry_type));
}

}  // namespace torch_xla_donate
