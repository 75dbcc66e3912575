// `_C.Record` and `_C.Entry`: CPython types, not pybind11 classes (a step makes one Entry per
// donor; a pybind11 instance costs several times more).  An Entry makes its Record lazily.
#include <new>

#include "common.h"
#include "reads.h"

namespace torch_xla_donate {
namespace {

PyTypeObject* g_record_type = nullptr;
PyTypeObject* g_entry_type = nullptr;
PyObject* g_verdicts[kVerdictCount] = {};  // the `_C.Verdict` members
PyObject* g_vias[kViaCount] = {};          // the `_C.Via` members

struct PyRecord {
  PyObject_HEAD RecordPtr record;
};

const Record& R(PyObject* self) { return *reinterpret_cast<PyRecord*>(self)->record; }

void RecordDealloc(PyObject* self) {
  reinterpret_cast<PyRecord*>(self)->record.~RecordPtr();
  FreeInstance(self);
}

PyObject* Str(const std::string& s) { return PyUnicode_FromStringAndSize(s.data(), s.size()); }

template <auto Field>
PyObject* GetInt(PyObject* self, void*) {
  return PyLong_FromLongLong(R(self).*Field);
}
PyObject* GetFile(PyObject* self, void*) { return Str(*R(self).file); }
PyObject* GetDtype(PyObject* self, void*) { return Str(R(self).dtype ? *R(self).dtype : ""); }
PyObject* GetVerdict(PyObject* self, void*) {
  return Py_NewRef(g_verdicts[static_cast<int>(R(self).verdict)]);
}
PyObject* GetVia(PyObject* self, void*) { return Py_NewRef(g_vias[static_cast<int>(R(self).via)]); }
PyObject* GetShapeString(PyObject* self, void*) { return Str(R(self).ShapeString()); }
PyObject* GetWhere(PyObject* self, void*) {
  return Str(*R(self).file + ":" + std::to_string(R(self).line));
}
PyObject* GetShape(PyObject* self, void*) {
  const Dims& shape = R(self).shape;
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(shape.size()));
  for (size_t i = 0; t && i < shape.size(); ++i) {
    PyObject* d = PyLong_FromLongLong(shape[i]);
    if (!d)
      Py_CLEAR(t);
    else
      PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), d);
  }
  return t;
}

PyObject* RecordRepr(PyObject* self) {
  const Record& r = R(self);
#define TDX_NAME(name) #name,
  static const char* const kVerdicts[] = {TDX_VERDICTS(TDX_NAME)};
#undef TDX_NAME
  return PyUnicode_FromFormat("<donation #%lld %s at %s:%d step=%lld %s>", (long long)r.id,
                              r.ShapeString().c_str(), r.file->c_str(), r.line, (long long)r.step,
                              kVerdicts[static_cast<int>(r.verdict)]);
}

PyGetSetDef kRecordGetters[] = {
    {"id", GetInt<&Record::id>, nullptr, "Unique number of this donation.", nullptr},
    {"step", GetInt<&Record::step>, nullptr, "The execution that committed it (-1: not yet).",
     nullptr},
    {"file", GetFile, nullptr, "File of the call that marked it.", nullptr},
    {"line", GetInt<&Record::line>, nullptr, "Line of the call that marked it.", nullptr},
    {"where", GetWhere, nullptr, "'file:line' of the call that marked it.", nullptr},
    {"shape", GetShape, nullptr, "Shape of the donated tensor.", nullptr},
    {"dtype", GetDtype, nullptr, "XLA's dtype name (f32, bf16, s64, ...).", nullptr},
    {"shape_string", GetShapeString, nullptr, "e.g. 'f32[4,4]'.", nullptr},
    {"nbytes", GetInt<&Record::nbytes>, nullptr, "Size of the donated buffer in bytes.", nullptr},
    {"verdict", GetVerdict, nullptr, "What became of the donation (Verdict).", nullptr},
    {"via", GetVia, nullptr, "The call that marked it (Via).", nullptr},
    {"version", GetInt<&Record::version>, nullptr, "The version counter when marked (-1: none).",
     nullptr},
    {nullptr, nullptr, nullptr, nullptr, nullptr},
};

struct PyEntry {
  PyObject_HEAD PyObject* tensor;  // None once released or weakened
  RecordPtr native;
  PyObject* record;       // its Record object, made when Python first asks
  uintptr_t weak;         // weakened: the tensor's TensorImpl, weakly
  bool buffer_on_record;  // released or weakened: Record::held is this entry's
};

PyEntry* AsEntry(PyObject* o) {
  return Py_TYPE(o) == g_entry_type ? reinterpret_cast<PyEntry*>(o) : nullptr;
}

PyObject* RecordObject(PyEntry* e) {  // borrowed
  if (e->record == nullptr) e->record = WrapRecord(e->native);
  return e->record;
}

void DropWeak(PyEntry* e) {
  if (e->native->weak_entry == e) e->native->weak_entry = nullptr;
  WeakTensorDrop(std::exchange(e->weak, 0));
}

bool KeepBufferOnRecord(PyObject* entry, HeldBuffer* buffer, uintptr_t weak) {
  PyEntry* e = AsEntry(entry);
  if (!e || e->buffer_on_record) return false;
  e->native->held = std::move(*buffer);
  e->buffer_on_record = true;
  e->weak = weak;
  if (weak != 0) e->native->weak_entry = e;  // GIL-guarded, as the entry
  Py_SETREF(e->tensor, Py_NewRef(Py_None));  // frees a released donor; a weakened one lives on
  return true;
}

void EntryDealloc(PyObject* self) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  if (e->buffer_on_record) e->native->held.reset();
  if (e->weak != 0) DropWeak(e);
  Py_CLEAR(e->tensor);
  Py_CLEAR(e->record);
  e->native.~RecordPtr();
  FreeInstance(self);
}

PyObject* EntryTensorRef(PyEntry* e) {  // new reference: the weakened one while it lives
  if (e->weak != 0) {
    PyObject* t = WeakTensorObject(e->weak);
    if (t != nullptr || PyErr_Occurred()) return t;
    Py_RETURN_NONE;
  }
  return Py_NewRef(e->tensor);
}

Py_ssize_t EntryLength(PyObject*) { return 2; }

PyObject* EntryItem(PyObject* self, Py_ssize_t i) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  if (i < 0 || i > 1) {
    PyErr_SetString(PyExc_IndexError, "an entry is (tensor, record)");
    return nullptr;
  }
  return i == 0 ? EntryTensorRef(e) : Py_XNewRef(RecordObject(e));
}

// `t, record = entry`: a tuple's iterator, without the sequence protocol's IndexError.
PyObject* EntryIter(PyObject* self) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  PyObject* record = RecordObject(e);
  PyObject* t = record ? EntryTensorRef(e) : nullptr;
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

PyType_Slot kRecordSlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(RecordDealloc)},
    {Py_tp_repr, reinterpret_cast<void*>(RecordRepr)},
    {Py_tp_getset, kRecordGetters},
    {Py_tp_doc, const_cast<char*>("One donation: where it was made, of what, and its verdict.")},
    {0, nullptr},
};

PyType_Slot kEntrySlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(EntryDealloc)},
    {Py_tp_repr, reinterpret_cast<void*>(EntryRepr)},
    {Py_sq_length, reinterpret_cast<void*>(EntryLength)},
    {Py_sq_item, reinterpret_cast<void*>(EntryItem)},
    {Py_tp_iter, reinterpret_cast<void*>(EntryIter)},
    {Py_tp_doc, const_cast<char*>("(tensor, record) of one donation, untracked by the GC.")},
    {0, nullptr},
};

}  // namespace

PyObject* WrapRecord(RecordPtr record) {
  PyObject* o = g_record_type->tp_alloc(g_record_type, 0);
  if (o) new (&reinterpret_cast<PyRecord*>(o)->record) RecordPtr(std::move(record));
  return o;
}

const RecordPtr& RecordArg(PyObject* o) {
  if (Py_TYPE(o) != g_record_type) throw py::type_error("expected a torch_xla_donate._C.Record");
  return reinterpret_cast<PyRecord*>(o)->record;
}

PyObject* NewEntry(PyObject* tensor, const RecordPtr& record) {
  PyObject* o = g_entry_type->tp_alloc(g_entry_type, 0);
  if (!o) return nullptr;
  auto* e = reinterpret_cast<PyEntry*>(o);
  e->tensor = Py_NewRef(tensor);
  new (&e->native) RecordPtr(record);  // the other fields: zeroed by tp_alloc
  return o;
}

bool EntryParts(PyObject* o, PyObject** tensor, const RecordPtr** record) {
  if (PyEntry* e = AsEntry(o)) {
    *tensor = e->tensor;
    *record = &e->native;
    return true;
  }
  if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 2 &&
      Py_TYPE(PyTuple_GET_ITEM(o, 1)) == g_record_type) {
    *tensor = PyTuple_GET_ITEM(o, 0);
    *record = &reinterpret_cast<PyRecord*>(PyTuple_GET_ITEM(o, 1))->record;
    return true;
  }
  return false;
}

bool ReleaseEntryTensor(PyObject* entry, HeldBuffer* buffer) {
  return KeepBufferOnRecord(entry, buffer, 0);
}

bool WeakenEntryTensor(PyObject* entry, HeldBuffer* buffer) {
  PyEntry* e = AsEntry(entry);
  if (!e || e->tensor == Py_None) return false;
  const uintptr_t weak = WeakTensorTake(e->tensor);
  if (weak == 0) return false;
  if (KeepBufferOnRecord(entry, buffer, weak)) return true;
  WeakTensorDrop(weak);
  return false;
}

void EntryLetGoOfDead(PyObject* entry) {
  PyEntry* e = AsEntry(entry);
  if (e && e->weak != 0 && !WeakTensorAlive(e->weak)) DropWeak(e);
}

void WeakenedTensorDying(uintptr_t impl, Record* record) {
  auto* e = static_cast<PyEntry*>(record->weak_entry);
  if (e != nullptr && e->weak == impl) DropWeak(e);
}

const HeldBuffer* EntryBuffer(PyObject* entry) {
  PyEntry* e = AsEntry(entry);
  return e && e->buffer_on_record && e->native->held ? &e->native->held : nullptr;
}

bool EntryTensorAlive(PyObject* entry) {
  PyEntry* e = AsEntry(entry);
  return !e || !e->buffer_on_record || (e->weak != 0 && WeakTensorAlive(e->weak));
}

void RegisterEntries(py::module_& m) {
  for (int v = 0; v < kVerdictCount; ++v) g_verdicts[v] = m.attr("Verdict")(v).release().ptr();
  for (int v = 0; v < kViaCount; ++v) g_vias[v] = m.attr("Via")(v).release().ptr();
  const unsigned flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_DISALLOW_INSTANTIATION;
  g_record_type = NewType("torch_xla_donate._C.Record", sizeof(PyRecord), kRecordSlots, flags);
  g_entry_type = NewType("torch_xla_donate._C.Entry", sizeof(PyEntry), kEntrySlots, flags);
  m.attr("Record") = py::handle(reinterpret_cast<PyObject*>(g_record_type));
  m.attr("Entry") = py::handle(reinterpret_cast<PyObject*>(g_entry_type));
}

}  // namespace torch_xla_donate
