// torch_xla_donate._C: Python bindings of the donation ledger, and the
// per-tensor hot path of marking and of the step barrier.
//
// The ledger knows nothing about torch_xla.  The hot path does ask torch_xla
// questions, but only through Python callables that torch_xla_donate._xla
// hands over at import (`bind`): torch_xla's wheel exports no C++ symbols to
// link against, and keeping every torch_xla call named in _xla.py keeps an
// upgrade's breakage in one place.  Questions about the torch tensor itself
// (device, storage sharing, sizes) are answered by torch's C++ headers, in
// tensor_facts.cpp.  What C++ saves is the interpreter work
// around those calls: with thousands of donated tensors per step, a Python
// loop costs more than the torch_xla calls it makes.
//
// Records are a small native type rather than a pybind11 class: a step
// creates one Python object per donation, and a pybind11 instance costs
// several times more to create and to read (`record.verdict`).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cctype>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <unordered_map>

#include "ledger.h"
#include "record_tag.h"
#include "tensor_facts.h"

namespace py = pybind11;
using namespace torch_xla_donate;

namespace {

constexpr int kVerdictCount = static_cast<int>(Verdict::kDisabled) + 1;

// The members of the Python IntEnum `_C.Verdict`, by value.  An IntEnum
// compares as an int, so `record.verdict != Verdict.IN_FLIGHT` is cheap.
PyObject* g_verdicts[kVerdictCount] = {};

PyObject* VerdictObject(Verdict v) {
  PyObject* o = g_verdicts[static_cast<int>(v)];
  Py_INCREF(o);
  return o;
}

// ---------------------------------------------------------------------------
// Record: the Python face of one ledger record.

struct PyRecord {
  PyObject_HEAD
  RecordPtr record;
};

PyTypeObject* g_record_type = nullptr;

const Record& R(PyObject* self) { return *reinterpret_cast<PyRecord*>(self)->record; }

PyObject* WrapRecord(RecordPtr record) {
  PyObject* o = g_record_type->tp_alloc(g_record_type, 0);
  if (!o) return nullptr;
  new (&reinterpret_cast<PyRecord*>(o)->record) RecordPtr(std::move(record));
  return o;
}

bool IsRecord(PyObject* o) { return Py_TYPE(o) == g_record_type; }

const RecordPtr& Unwrap(PyObject* o) { return reinterpret_cast<PyRecord*>(o)->record; }

void RecordDealloc(PyObject* self) {
  reinterpret_cast<PyRecord*>(self)->record.~RecordPtr();
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);  // instances of a heap type own a reference to it
}

PyObject* RecordRepr(PyObject* self) {
  const Record& r = R(self);
  std::string s = "<donation #" + std::to_string(r.id) + " " + r.ShapeString() +
                  " at " + r.Where() + " step=" + std::to_string(r.step) + " " +
                  VerdictName(r.verdict) + ">";
  return PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
}

PyObject* Str(const std::string& s) {
  return PyUnicode_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size()));
}

PyObject* GetId(PyObject* self, void*) { return PyLong_FromLongLong(R(self).id); }
PyObject* GetStep(PyObject* self, void*) { return PyLong_FromLongLong(R(self).step); }
PyObject* GetFile(PyObject* self, void*) { return Str(*R(self).file); }
PyObject* GetLine(PyObject* self, void*) { return PyLong_FromLong(R(self).line); }
PyObject* GetDtype(PyObject* self, void*) { return Str(R(self).dtype); }
PyObject* GetNbytes(PyObject* self, void*) { return PyLong_FromLongLong(R(self).nbytes); }
PyObject* GetVerdict(PyObject* self, void*) { return VerdictObject(R(self).verdict); }
PyObject* GetShapeString(PyObject* self, void*) { return Str(R(self).ShapeString()); }
PyObject* GetWhere(PyObject* self, void*) { return Str(R(self).Where()); }

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
    {"step", GetStep, nullptr, "The step barrier that committed it (-1: not yet).", nullptr},
    {"file", GetFile, nullptr, "File of the donate_buffer call.", nullptr},
    {"line", GetLine, nullptr, "Line of the donate_buffer call.", nullptr},
    {"shape", GetShape, nullptr, "Shape of the donated tensor.", nullptr},
    {"dtype", GetDtype, nullptr, "XLA-style dtype name (f32, bf16, s64, ...).", nullptr},
    {"nbytes", GetNbytes, nullptr, "Size of the donated buffer in bytes.", nullptr},
    {"verdict", GetVerdict, nullptr, "What became of the donation (Verdict).", nullptr},
    {"shape_string", GetShapeString, nullptr, "e.g. 'f32[4,4]'.", nullptr},
    {"where", GetWhere, nullptr, "'file:line' of the donate_buffer call.", nullptr},
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

py::object RecordOrNone(RecordPtr r) {
  if (!r) return py::none();
  PyObject* o = WrapRecord(std::move(r));
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

// ---------------------------------------------------------------------------
// Entry: one (tensor, record) pair among a step's donors or open verdicts.
//
// A tuple would do, but a tuple that holds a tensor is tracked by Python's
// garbage collector, and a step with 10,000 donations keeps 10,000 of them
// alive until the next barrier: they reach the oldest generation and make
// full collections (which walk every object of the program) run several
// times more often.  An Entry is not tracked.  It cannot close a reference
// cycle: nothing refers back to it (a poisoned tensor refers to its record,
// never to its entry).  It unpacks and indexes like the pair it stands for.

struct PyEntry {
  PyObject_HEAD
  PyObject* tensor;
  PyObject* record;
};

PyTypeObject* g_entry_type = nullptr;

PyObject* NewEntry(PyObject* tensor, PyObject* record) {
  PyObject* o = g_entry_type->tp_alloc(g_entry_type, 0);
  if (!o) return nullptr;
  auto* e = reinterpret_cast<PyEntry*>(o);
  Py_INCREF(tensor);
  Py_INCREF(record);
  e->tensor = tensor;
  e->record = record;
  return o;
}

void EntryDealloc(PyObject* self) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  Py_CLEAR(e->tensor);
  Py_CLEAR(e->record);
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

Py_ssize_t EntryLength(PyObject*) { return 2; }

PyObject* EntryItem(PyObject* self, Py_ssize_t i) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  if (i < 0 || i > 1) {
    PyErr_SetString(PyExc_IndexError, "an entry is (tensor, record)");
    return nullptr;
  }
  PyObject* item = i == 0 ? e->tensor : e->record;
  Py_INCREF(item);
  return item;
}

PyObject* EntryRepr(PyObject* self) {
  auto* e = reinterpret_cast<PyEntry*>(self);
  return PyUnicode_FromFormat("<entry %R>", e->record);
}

PyType_Slot kEntrySlots[] = {
    {Py_tp_dealloc, reinterpret_cast<void*>(EntryDealloc)},
    {Py_tp_repr, reinterpret_cast<void*>(EntryRepr)},
    {Py_sq_length, reinterpret_cast<void*>(EntryLength)},
    {Py_sq_item, reinterpret_cast<void*>(EntryItem)},
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

// The (tensor, record) of an Entry or of a 2-tuple; false if `o` is neither.
bool EntryParts(PyObject* o, PyObject** tensor, PyObject** record) {
  if (Py_TYPE(o) == g_entry_type) {
    *tensor = reinterpret_cast<PyEntry*>(o)->tensor;
    *record = reinterpret_cast<PyEntry*>(o)->record;
    return true;
  }
  if (PyTuple_Check(o) && PyTuple_GET_SIZE(o) == 2) {
    *tensor = PyTuple_GET_ITEM(o, 0);
    *record = PyTuple_GET_ITEM(o, 1);
    return true;
  }
  return false;
}

// ---------------------------------------------------------------------------
// The hot path's view of torch and torch_xla: callables bound at import.

struct Hooks {
  PyObject* tensor_type = nullptr;        // torch.Tensor
  PyObject* set_donor = nullptr;          // (tensor, bool) -> bool
  PyObject* buffer_deleted = nullptr;     // tensor -> bool
  PyObject* need_materialization = nullptr;  // [tensor] -> [bool]
  PyObject* storage_use_count = nullptr;  // storage._cdata -> int
  PyObject* dtype_info = nullptr;         // dtype -> (xla name, itemsize)
  PyObject* donated_type = nullptr;       // poison._DonatedTensor
  PyObject* poison_class_for = nullptr;   // type -> poisoned twin
  PyObject* fast_types = nullptr;         // tuple: exact types of the fast path

  bool torch_bound() const {
    return tensor_type && set_donor && buffer_deleted && need_materialization &&
           storage_use_count && dtype_info;
  }
  bool poison_bound() const { return donated_type && poison_class_for; }
};

Hooks g_hooks;

struct Names {
  PyObject *is_view, *dtype, *untyped_storage, *cdata, *klass, *co_filename, *is_leaf,
      *requires_grad;
};
Names g_names;

struct DtypeInfo {
  std::string name;
  int64_t itemsize;
};
// Keyed by the dtype object (torch dtypes are singletons); the map holds a
// reference to each key so an address is never reused for another dtype.
std::unordered_map<PyObject*, DtypeInfo> g_dtypes;
std::unordered_map<PyTypeObject*, PyObject*> g_poison_classes;

// 1 / 0 for the truth of `o` (a new reference, consumed), -1 on error.
int Truth(PyObject* o) {
  if (!o) return -1;
  int r = PyObject_IsTrue(o);
  Py_DECREF(o);
  return r;
}

int IsView(PyObject* t) { return Truth(PyObject_CallMethodNoArgs(t, g_names.is_view)); }
int BufferDeleted(PyObject* t) { return Truth(PyObject_CallOneArg(g_hooks.buffer_deleted, t)); }

int SetDonor(PyObject* t, bool donate) {
  PyObject* args[2] = {t, donate ? Py_True : Py_False};
  return Truth(PyObject_Vectorcall(g_hooks.set_donor, args, 2, nullptr));
}

bool IsTensor(PyObject* t);

// The address of a torch tensor's c10::TensorImpl (`t._cdata`); 0 when `t`
// is no torch tensor.  False with a Python error set.
bool ImplAddress(PyObject* t, uintptr_t* impl) {
  *impl = 0;
  if (!IsTensor(t)) return true;
  PyObject* cdata = PyObject_GetAttr(t, g_names.cdata);
  if (!cdata) return false;
  *impl = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(cdata));
  Py_DECREF(cdata);
  return !PyErr_Occurred();
}

// The native facts of a torch tensor (tensor_facts.h).  1 read, 0 not a
// tensor or torch raised (the caller takes the Python route), -1 error.
int Facts(PyObject* t, TensorFacts* facts, bool with_sizes = true) {
  uintptr_t impl = 0;
  if (!ImplAddress(t, &impl)) return -1;
  return impl != 0 && ReadTensorFacts(impl, facts, with_sizes) ? 1 : 0;
}

// torch._C._storage_Use_Count(t.untyped_storage()._cdata), as _xla.py's
// storage_use_count: 1 unless views or aliases of t are alive.  The Python
// route, for what tensor_facts cannot read.  -1 on error.
long StorageUseCountViaPython(PyObject* t) {
  PyObject* storage = PyObject_CallMethodNoArgs(t, g_names.untyped_storage);
  if (!storage) return -1;
  PyObject* cdata = PyObject_GetAttr(storage, g_names.cdata);
  Py_DECREF(storage);
  if (!cdata) return -1;
  PyObject* n = PyObject_CallOneArg(g_hooks.storage_use_count, cdata);
  Py_DECREF(cdata);
  if (!n) return -1;
  long count = PyLong_AsLong(n);
  Py_DECREF(n);
  return count;
}

// The same count, from `facts` when Facts() read them (`read` is its
// result) and they have it, else the Python route.  -1 on error.
long StorageUseCount(PyObject* t, int read, const TensorFacts& facts) {
  if (read == 1 && facts.storage_use_count > 0) return facts.storage_use_count;
  return StorageUseCountViaPython(t);
}

// Does `t` hold pending computation?  One-element form of
// _xla.has_pending_ir.  1 / 0, -1 on error.
int HasPendingIr(PyObject* t) {
  PyObject* list = PyList_New(1);
  if (!list) return -1;
  Py_INCREF(t);
  PyList_SET_ITEM(list, 0, t);
  PyObject* flags = PyObject_CallOneArg(g_hooks.need_materialization, list);
  Py_DECREF(list);
  if (!flags) return -1;
  PyObject* first = PySequence_GetItem(flags, 0);
  Py_DECREF(flags);
  return Truth(first);
}

const DtypeInfo* LookupDtype(PyObject* dtype) {
  auto it = g_dtypes.find(dtype);
  if (it != g_dtypes.end()) return &it->second;
  PyObject* info = PyObject_CallOneArg(g_hooks.dtype_info, dtype);
  if (!info) return nullptr;
  DtypeInfo d;
  PyObject *name = nullptr, *size = nullptr;
  bool ok = PyTuple_Check(info) && PyTuple_GET_SIZE(info) == 2 &&
            PyUnicode_Check(name = PyTuple_GET_ITEM(info, 0)) &&
            PyLong_Check(size = PyTuple_GET_ITEM(info, 1));
  if (ok) {
    d.name = PyUnicode_AsUTF8(name);
    d.itemsize = PyLong_AsLongLong(size);
  }
  Py_DECREF(info);
  if (!ok) {
    PyErr_SetString(PyExc_TypeError, "dtype_info must return (str, int)");
    return nullptr;
  }
  Py_INCREF(dtype);
  return &g_dtypes.emplace(dtype, std::move(d)).first->second;
}

// The dtype of each c10::ScalarType seen so far, filled from LookupDtype.
const DtypeInfo* g_dtype_by_scalar_type[64] = {};

// Shape, XLA dtype name and byte size of `t` (whose `facts` were read), as
// api._mark records them.  The shape is moved out of `facts.sizes` (one
// allocation less per mark).  1 ok, 0 unusual (symbolic sizes: let the
// Python path handle it), -1 error.
int Describe(PyObject* t, TensorFacts& facts, std::vector<int64_t>* shape,
             std::string* dtype, int64_t* nbytes) {
  if (facts.symbolic_sizes) return 0;
  int64_t numel = 1;
  for (int64_t d : facts.sizes) numel *= d;
  const int st = facts.scalar_type;
  const bool cacheable = st >= 0 && st < 64;
  const DtypeInfo* info = cacheable ? g_dtype_by_scalar_type[st] : nullptr;
  if (!info) {  // first tensor of this dtype: ask Python once
    PyObject* dt = PyObject_GetAttr(t, g_names.dtype);
    if (!dt) return -1;
    info = LookupDtype(dt);
    Py_DECREF(dt);
    if (!info) return -1;
    if (cacheable && info->itemsize == facts.itemsize) g_dtype_by_scalar_type[st] = info;
  }
  shape->swap(facts.sizes);
  *dtype = info->name;
  *nbytes = numel * info->itemsize;
  return 1;
}

// -- Where a donation was made ----------------------------------------------
//
// Every record names the file:line of the donate_buffer call.  Asking Python
// for it on every call was most of a mark's cost: a frame's line number is
// found by scanning its code's line table from the start.  So file names are
// shared per code object, and line numbers cached per (code, instruction).
// The caches hold a reference to each code object they key on, so that an
// address is never reused while it is a key, and stop growing at a bound
// (a program that donates from more places pays the uncached price there).

constexpr size_t kMaxCachedCodes = 4096;
constexpr size_t kMaxCachedLinesPerCode = 256;

struct CodeInfo {
  FilePtr file;
  std::unordered_map<int, int> lines;  // instruction offset -> line
};
std::unordered_map<PyObject*, CodeInfo> g_codes;
// File names given as str (the `where` tuples of helpers), by str object.
std::unordered_map<PyObject*, FilePtr> g_file_names;

FilePtr NewFile(PyObject* name) {
  const char* s = PyUnicode_AsUTF8(name);
  return s ? std::make_shared<const std::string>(s) : nullptr;
}

FilePtr FileNamed(PyObject* name) {
  auto it = g_file_names.find(name);
  if (it != g_file_names.end()) return it->second;
  FilePtr file = NewFile(name);
  if (file && g_file_names.size() < kMaxCachedCodes) {
    Py_INCREF(name);  // held by the cache
    g_file_names.emplace(name, file);
  }
  return file;
}

FilePtr CodeFile(PyObject* code) {
  PyObject* name = PyObject_GetAttr(code, g_names.co_filename);
  if (!name) return nullptr;
  FilePtr file = NewFile(name);
  Py_DECREF(name);
  return file;
}

// File and line of `frame`, through the caches.  False with a Python error.
bool FrameWhere(PyFrameObject* frame, FilePtr* file, int* line) {
  PyObject* code = reinterpret_cast<PyObject*>(PyFrame_GetCode(frame));  // new ref
  auto it = g_codes.find(code);
  if (it == g_codes.end()) {
    FilePtr f = CodeFile(code);
    if (!f || g_codes.size() >= kMaxCachedCodes) {
      Py_DECREF(code);
      *file = std::move(f);
      *line = PyFrame_GetLineNumber(frame);
      return *file != nullptr;
    }
    Py_INCREF(code);  // held by the cache
    it = g_codes.emplace(code, CodeInfo{std::move(f), {}}).first;
  }
  Py_DECREF(code);
  CodeInfo& info = it->second;
  *file = info.file;
  const int lasti = PyFrame_GetLasti(frame);
  auto l = info.lines.find(lasti);
  if (l != info.lines.end()) {
    *line = l->second;
  } else {
    *line = PyFrame_GetLineNumber(frame);
    if (info.lines.size() < kMaxCachedLinesPerCode) info.lines.emplace(lasti, *line);
  }
  return true;
}

// The (file, line) to blame: `where` is either such a tuple, or a number of
// frames to go up from the Python function that called into _C (1: its
// caller), as api._caller does with sys._getframe.
bool ResolveWhere(PyObject* where, FilePtr* file, int* line) {
  if (PyLong_Check(where)) {
    long depth = PyLong_AsLong(where);
    PyFrameObject* frame = PyEval_GetFrame();  // borrowed
    Py_XINCREF(frame);
    for (long i = 0; i < depth && frame; ++i) {
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
    if (!frame) {
      static const FilePtr kUnknown = std::make_shared<const std::string>("<unknown>");
      *file = kUnknown;
      *line = 0;
      return true;
    }
    bool ok = FrameWhere(frame, file, line);
    Py_DECREF(frame);
    return ok;
  }
  if (PyTuple_Check(where) && PyTuple_GET_SIZE(where) == 2 &&
      PyUnicode_Check(PyTuple_GET_ITEM(where, 0))) {
    long l = PyLong_AsLong(PyTuple_GET_ITEM(where, 1));
    if (l == -1 && PyErr_Occurred()) return false;
    *file = FileNamed(PyTuple_GET_ITEM(where, 0));
    *line = static_cast<int>(l);
    return *file != nullptr;
  }
  PyErr_SetString(PyExc_TypeError, "where must be (file, line) or a frame depth");
  return false;
}

// Tags t's TensorImpl with `record` (record_tag.h).  0 ok, -1 error (a
// TypeError if `t` is no torch tensor or torch refused the tag).
int TagTensor(PyObject* t, const RecordPtr& record) {
  uintptr_t impl = 0;
  if (!ImplAddress(t, &impl)) return -1;
  if (impl == 0) {
    PyErr_SetString(PyExc_TypeError, "expected a torch.Tensor");
    return -1;
  }
  if (!TagRecord(impl, record)) {
    PyErr_SetString(PyExc_TypeError, "cannot tag this tensor with its donation record");
    return -1;
  }
  return 0;
}

// True when the one reference its entry holds is the only way to reach the
// tensor `t`: no other Python reference, no weak reference, and no C++ owner
// of its TensorImpl (an autograd graph) that could hand it back to Python.
// The caller must hold no reference of its own.  1 yes, 0 no, -1 error.
int OnlyHeldByItsEntry(PyObject* t) {
  if (Py_REFCNT(t) != 1) return 0;
#if PY_VERSION_HEX < 0x030C0000
  if (Py_TYPE(t)->tp_weaklistoffset > 0 && *PyObject_GET_WEAKREFS_LISTPTR(t) != nullptr) return 0;
#else
  return 0;  // weak references are managed by the interpreter: assume some
#endif
  TensorFacts facts;
  int read = Facts(t, &facts, /*with_sizes=*/false);
  if (read < 0) return -1;
  return read == 1 && facts.impl_use_count == 1 ? 1 : 0;
}

// Mirrors poison.poison(t, record): t's TensorImpl is tagged with the record
// and t takes the donated twin of its class.  0 ok, -1 error.
int Poison(PyObject* t, PyObject* record) {
  if (TagTensor(t, Unwrap(record)) < 0) return -1;
  if (PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g_hooks.donated_type))) return 0;
  PyTypeObject* type = Py_TYPE(t);
  PyObject* twin;
  auto it = g_poison_classes.find(type);
  if (it != g_poison_classes.end()) {
    twin = it->second;
  } else {
    twin = PyObject_CallOneArg(g_hooks.poison_class_for, reinterpret_cast<PyObject*>(type));
    if (!twin) return -1;
    Py_INCREF(type);  // keep the key alive: its address must not be reused
    g_poison_classes.emplace(type, twin);
  }
  return PyObject_SetAttr(t, g_names.klass, twin);
}

bool IsTensor(PyObject* t) {
  return PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g_hooks.tensor_type));
}
bool IsDonatedType(PyObject* t) {
  return g_hooks.donated_type &&
         PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g_hooks.donated_type));
}

// Only plain tensors and parameters take the fast path: every other class
// (a user subclass, a wrapper subclass with __torch_dispatch__, a poisoned
// tensor) has its own checks in api.py.
bool IsPlainTensor(PyObject* t) {
  if (!g_hooks.fast_types) return IsTensor(t) && !IsDonatedType(t);
  PyObject* types = g_hooks.fast_types;
  for (Py_ssize_t i = 0, n = PyTuple_GET_SIZE(types); i < n; ++i)
    if (reinterpret_cast<PyObject*>(Py_TYPE(t)) == PyTuple_GET_ITEM(types, i)) return true;
  return false;
}

// api's "held by autograd" check: C++ code besides `t` holds its TensorImpl
// (a graph that saved it for backward), not counting the AccumulateGrad node
// of a leaf that requires grad.  1 held, 0 not, -1 error.
int HeldByAutograd(PyObject* t, const TensorFacts& facts) {
  if (facts.impl_use_count <= 1) return 0;
  int leaf = Truth(PyObject_GetAttr(t, g_names.is_leaf));
  if (leaf < 0) return -1;
  int grad = leaf ? Truth(PyObject_GetAttr(t, g_names.requires_grad)) : 0;
  if (grad < 0) return -1;
  return facts.impl_use_count > 1 + (leaf && grad) ? 1 : 0;
}

// The checks of api._check_donatable that pass for an ordinary donation,
// except the pending-IR one (see TryMark) and the 0-dim one.  Fills `facts`.
// 1 pass, 0 fail, -1 error.
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

// -- When the fast path may mark -------------------------------------------
//
// TryMark marks without taking step_hook._lock: it runs entirely in C++ while
// holding the GIL and calls no Python code (only torch and torch_xla
// builtins), so no other Python thread runs in between.  That alone is not
// enough: another thread may hold the lock in the middle of a barrier (the
// marks committed, the graph not built yet, or the GIL released inside
// torch_xla).  A mark then must wait for the lock, so while any thread holds
// it (step_hook counts them here) the fast path declines and api.py's slow
// path takes the lock.  The fast path is also closed while donation is
// switched off (config.enabled(), XLA_ENABLE_PARAM_ALIASING=0): the slow
// path warns then.
int g_lock_holders = 0;
bool g_fast_enabled = false;

bool FastPathOpen() {
  return g_lock_holders == 0 && g_fast_enabled && g_hooks.torch_bound() &&
         g_hooks.poison_bound();
}

PyObject* FalseClearingErrors() {
  PyErr_Clear();
  Py_RETURN_FALSE;
}

// A tensor that passed try_mark's checks, with what its ledger record needs.
struct Candidate {
  PyObject* tensor = nullptr;  // borrowed
  std::vector<int64_t> shape;
  std::string dtype;
  int64_t nbytes = 0;
};

// try_mark's checks (plain XLA tensor, no view, no alias, not held by
// autograd, ordinary sizes), changing nothing.  True with `c` filled; false,
// errors cleared, when the Python path must decide.  The pending-IR check is
// left to torch_xla's donor flag (see TryMark).
bool Prepare(PyObject* t, Candidate* c) {
  TensorFacts facts;
  if (CommonChecks(t, &facts) != 1 || Describe(t, facts, &c->shape, &c->dtype, &c->nbytes) != 1) {
    PyErr_Clear();
    return false;
  }
  c->tensor = t;
  return true;
}

// The ledger entry of a candidate whose donor flag is set.
void MarkCandidate(Candidate&& c, const FilePtr& file, int line) {
  GlobalLedger().Mark(py::reinterpret_borrow<py::object>(c.tensor), file, line,
                      std::move(c.shape), std::move(c.dtype), c.nbytes);
}

// try_mark(tensor, where) -> bool
//
// The common case of api._mark in one call: True once `tensor` is marked.
// False, having changed nothing, whenever anything is unusual (not a plain
// materialized XLA tensor, views alive, already marked, donation switched
// off by XLA_ENABLE_PARAM_ALIASING, a probe raised): the Python path then
// redoes everything and gives the precise error or warning.
//
// torch_xla refuses the donor flag (returns False) for a tensor with pending
// IR, so setting the flag doubles as the pending-computation check; it comes
// last because it is the one step with an effect.
PyObject* TryMark(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "try_mark(tensor, where) takes 2 arguments");
    return nullptr;
  }
  PyObject* t = args[0];
  if (!FastPathOpen()) Py_RETURN_FALSE;
  Candidate c;
  if (!Prepare(t, &c)) Py_RETURN_FALSE;
  if (GlobalLedger().IsMarked(py::handle(t))) Py_RETURN_FALSE;
  FilePtr file;
  int line = 0;
  if (!ResolveWhere(args[1], &file, &line)) return nullptr;  // caller's bug
  if (c.shape.empty()) Py_RETURN_FALSE;  // 0-dim: api refuses it, with a reason
  if (SetDonor(t, true) != 1) return FalseClearingErrors();
  MarkCandidate(std::move(c), file, line);
  Py_RETURN_TRUE;
}

// is_donatable(tensor) -> bool: True if api._check_donatable would pass.
// False means "ask the Python checks", which raise the precise error.
PyObject* IsDonatable(PyObject*, PyObject* t) {
  if (!g_hooks.torch_bound()) Py_RETURN_FALSE;
  TensorFacts facts;
  if (CommonChecks(t, &facts) != 1) return FalseClearingErrors();
  if (facts.symbolic_sizes || facts.sizes.empty()) Py_RETURN_FALSE;  // 0-dim: api refuses it
  if (HasPendingIr(t) != 0) return FalseClearingErrors();
  Py_RETURN_TRUE;
}

// try_mark_all(tensors, where) -> int
//
// donate(tree)'s common case in one call, all or nothing: every tensor of
// the (deduplicated) list is a plain materialized XLA tensor that passes
// try_mark's checks, or already marked, or a materialized 0-dim scalar
// (skipped: donate() never donates scalars).  Then all are marked and the
// number of them now marked (scalars excluded) is returned.  Otherwise -1,
// having changed nothing: the Python path redoes the work and names the
// tensor at fault by its path.
PyObject* TryMarkAll(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "try_mark_all(list_of_tensors, where)");
    return nullptr;
  }
  // Called with step_hook._lock held, so only the switches count here.
  if (!g_hooks.torch_bound() || !g_hooks.poison_bound() || !g_fast_enabled)
    return PyLong_FromLong(-1);
  FilePtr file;
  int line = 0;
  if (!ResolveWhere(args[1], &file, &line)) return nullptr;  // caller's bug
  std::vector<Candidate> todo;
  long already = 0;
  PyObject* list = args[0];
  // Phase 1: check everything, change nothing.
  for (Py_ssize_t i = 0, n = PyList_GET_SIZE(list); i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(list, i);
    if (GlobalLedger().IsMarked(py::handle(t))) {
      ++already;
      continue;
    }
    Candidate c;
    if (!Prepare(t, &c)) return PyLong_FromLong(-1);
    if (c.shape.empty()) {  // a scalar: skipped, if donate_buffer would accept it
      if (HasPendingIr(t) != 0) {
        PyErr_Clear();
        return PyLong_FromLong(-1);
      }
      continue;
    }
    todo.push_back(std::move(c));
  }
  // Phase 2: mark.  torch_xla refuses the flag for pending IR (the check
  // phase 1 left to it): undo this call's flags and let Python explain.
  for (size_t i = 0; i < todo.size(); ++i) {
    if (SetDonor(todo[i].tensor, true) != 1) {
      PyErr_Clear();
      for (size_t j = 0; j < i; ++j) SetDonor(todo[j].tensor, false);
      PyErr_Clear();
      return PyLong_FromLong(-1);
    }
  }
  long marked = already + static_cast<long>(todo.size());
  for (auto& c : todo) MarkCandidate(std::move(c), file, line);
  return PyLong_FromLong(marked);
}

PyMethodDef kFastMethods[] = {
    {"try_mark", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(TryMark)),
     METH_FASTCALL,
     "try_mark(tensor, where) -> bool\n\nMarks a plain materialized XLA tensor in "
     "one call; False (nothing changed) when the Python path must decide."},
    {"try_mark_all", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(TryMarkAll)),
     METH_FASTCALL,
     "try_mark_all(tensors, where) -> int\n\nMarks a list of distinct plain "
     "materialized XLA tensors, all or nothing (0-dim ones skipped); -1 (nothing "
     "changed) when the Python path must decide."},
    {"is_donatable", IsDonatable, METH_O,
     "is_donatable(tensor) -> bool\n\nTrue when every check of donate_buffer "
     "passes; False when the Python checks must say why not."},
    {nullptr, nullptr, 0, nullptr},
};

// ---------------------------------------------------------------------------
// Batch helpers of the step hook.  Each replaces one Python loop of
// step_hook.py and does exactly what that loop did, entry by entry.

void Check(bool ok) {
  if (!ok) throw py::error_already_set();
}

void RequireBound() {
  if (!g_hooks.torch_bound() || !g_hooks.poison_bound())
    throw std::runtime_error("torch_xla_donate._C: hooks are not bound (import torch_xla_donate)");
}

const RecordPtr& RecordArg(PyObject* o) {
  if (!IsRecord(o)) throw py::type_error("expected a torch_xla_donate._C.Record");
  return Unwrap(o);
}

// Splits a committed step (`tensors`, `records`, with `pending`: which ones
// hold pending IR) into donors and drops:
//  * pending: updated in place after marking, an output: UPDATED_IN_PLACE;
//  * views or aliases alive, or saved for backward by an autograd graph
//    built after marking: donor flag cleared, CANCELLED, listed as dropped;
//  * the rest stay donors, as (tensor, record) Entry pairs.
// Returns (donors, dropped records).
py::tuple SplitCommitted(py::list tensors, py::list records, py::object pending) {
  RequireBound();
  py::list donors, dropped;
  size_t n = tensors.size();
  if (records.size() != n) throw py::value_error("tensors and records differ in length");
  if (n == 0) return py::make_tuple(donors, dropped);
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
    long uses = StorageUseCount(t, read, facts);
    Check(!(uses == -1 && PyErr_Occurred()));
    int held = uses <= 1 && read == 1 ? HeldByAutograd(t, facts) : 0;
    Check(held >= 0);
    if (uses > 1 || held) {
      Check(SetDonor(t, false) >= 0);
      GlobalLedger().Settle(record, Verdict::kCancelled);
      dropped.append(py::handle(rec));
    } else {
      PyObject* entry = NewEntry(t, rec);
      Check(entry != nullptr);
      int appended = PyList_Append(donors.ptr(), entry);
      Py_DECREF(entry);
      Check(appended == 0);
    }
  }
  return py::make_tuple(donors, dropped);
}

// After the real barrier: poison each (tensor, record) donor.  Its torch_xla
// donor flag stays set until its verdict: a consumed buffer is gone with its
// flag, and step_hook clears the flag of an unused one when it settles it (a
// flag the step did not use would fire at a later step).  Until then the
// tensor is poisoned, so no later graph can take it as an input without
// first settling it.  No verdict yet, even for a buffer that reads as deleted
// already: while the step is being dispatched, XLA holds a donated buffer in
// a way that reads as deleted, and gives it back if the step then fails
// (measured: 3 runs in 300 of a step failing out of memory).  Only a
// deletion seen once the step was dispatched is certain (step_hook._settle).
//
// A donor that nothing but its entry refers to is left as it is: the user
// dropped it (`params = [p - lr * g for p in params]`), so nobody can use
// it again, and poisoning it would only make freeing it dearer.
void PoisonDonors(py::list donors) {
  RequireBound();
  for (size_t i = 0, n = donors.size(); i < n; ++i) {
    PyObject *t, *rec;
    if (!EntryParts(PyList_GET_ITEM(donors.ptr(), i), &t, &rec))
      throw py::type_error("donors must be (tensor, record) pairs");
    RecordArg(rec);  // type check
    int unreachable = OnlyHeldByItsEntry(t);
    Check(unreachable >= 0);
    if (!unreachable) Check(Poison(t, rec) == 0);
  }
}

// poison.py's access to the record tag of a tensor (record_tag.h).
void TagRecordOf(py::handle t, py::handle record) {
  Check(TagTensor(t.ptr(), RecordArg(record.ptr())) == 0);
}

py::object TaggedRecordOf(py::handle t) {
  uintptr_t impl = 0;
  Check(ImplAddress(t.ptr(), &impl));
  RecordPtr record = impl ? TaggedRecord(impl) : RecordPtr();
  if (!record) return py::none();
  return py::reinterpret_steal<py::object>(WrapRecord(std::move(record)));
}

void UntagRecordOf(py::handle t) {
  uintptr_t impl = 0;
  Check(ImplAddress(t.ptr(), &impl));
  if (impl) UntagRecord(impl);
}

// Settles in-flight (tensor, record) entries: a deleted buffer is CONSUMED;
// a live one is unused only if `certain` that its step was dispatched.
// Entries settled meanwhile (by a use of the tensor) are skipped.
// Returns (still unknown entries, unused entries); the caller un-poisons
// and warns about the unused ones, and settles them UNUSED.
py::tuple SettleEntries(py::list entries, bool certain) {
  RequireBound();
  py::list unknown, unused;
  for (size_t i = 0, n = entries.size(); i < n; ++i) {
    PyObject* entry = PyList_GET_ITEM(entries.ptr(), i);
    PyObject *t, *rec;
    if (!EntryParts(entry, &t, &rec))
      throw py::type_error("entries must be (tensor, record) pairs");
    const RecordPtr& record = RecordArg(rec);
    if (record->verdict != Verdict::kInFlight) continue;
    int deleted = BufferDeleted(t);
    Check(deleted >= 0);
    if (deleted) {
      GlobalLedger().Settle(record, Verdict::kConsumed);
    } else {
      (certain ? unused : unknown).append(py::handle(entry));
    }
  }
  return py::make_tuple(unknown, unused);
}

void Bind(py::kwargs hooks) {
  static const std::pair<const char*, PyObject* Hooks::*> kSlots[] = {
      {"tensor_type", &Hooks::tensor_type},
      {"set_donor", &Hooks::set_donor},
      {"buffer_deleted", &Hooks::buffer_deleted},
      {"need_materialization", &Hooks::need_materialization},
      {"storage_use_count", &Hooks::storage_use_count},
      {"dtype_info", &Hooks::dtype_info},
      {"donated_type", &Hooks::donated_type},
      {"poison_class_for", &Hooks::poison_class_for},
      {"fast_types", &Hooks::fast_types},
  };
  for (auto item : hooks) {
    std::string name = py::str(item.first);
    bool known = false;
    for (const auto& slot : kSlots) {
      if (name != slot.first) continue;
      known = true;
      PyObject*& field = g_hooks.*(slot.second);
      PyObject* value = item.second.ptr();
      Py_INCREF(value);
      Py_XSETREF(field, value);
    }
    if (!known) throw py::type_error("bind(): unknown hook '" + name + "'");
    if (name == "fast_types" && !PyTuple_Check(g_hooks.fast_types)) {
      Py_CLEAR(g_hooks.fast_types);
      throw py::type_error("bind(): fast_types must be a tuple of types");
    }
    if (name == "poison_class_for") {
      for (auto& kv : g_poison_classes) {
        Py_DECREF(kv.second);
        Py_DECREF(reinterpret_cast<PyObject*>(kv.first));
      }
      g_poison_classes.clear();
    }
  }
}

// ---------------------------------------------------------------------------

py::dict StatsToDict(const StepStats& s) {
  py::dict d;
  d["step"] = s.step;
  d["donated"] = s.donated;
  d["donated_bytes"] = s.donated_bytes;
  d["consumed"] = s.consumed;
  d["consumed_bytes"] = s.consumed_bytes;
  d["unused"] = s.unused;
  d["unused_bytes"] = s.unused_bytes;
  d["unused_shapes"] = s.unused_shapes;
  d["updated_in_place"] = s.updated_in_place;
  d["updated_in_place_bytes"] = s.updated_in_place_bytes;
  d["dropped"] = s.dropped;
  d["dropped_bytes"] = s.dropped_bytes;
  d["failed"] = s.failed;
  d["failed_bytes"] = s.failed_bytes;
  d["pending"] = s.pending;
  d["steps"] = s.steps;
  return d;
}

void InitNames() {
  g_names.is_view = PyUnicode_InternFromString("_is_view");
  g_names.dtype = PyUnicode_InternFromString("dtype");
  g_names.untyped_storage = PyUnicode_InternFromString("untyped_storage");
  g_names.cdata = PyUnicode_InternFromString("_cdata");
  g_names.klass = PyUnicode_InternFromString("__class__");
  g_names.co_filename = PyUnicode_InternFromString("co_filename");
  g_names.is_leaf = PyUnicode_InternFromString("is_leaf");
  g_names.requires_grad = PyUnicode_InternFromString("requires_grad");
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native donation ledger of torch_xla_donate.";
  InitNames();

  // Verdict: an IntEnum, so comparisons are int comparisons.
  py::list members;
  for (int v = 0; v < kVerdictCount; ++v) {
    std::string name = VerdictName(static_cast<Verdict>(v));
    for (auto& c : name) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    members.append(py::make_tuple(name, v));
  }
  py::object verdict = py::module_::import("enum").attr("IntEnum")(
      "Verdict", members, py::arg("module") = "torch_xla_donate._C");
  verdict.attr("__doc__") = "What became of one donation; only CONSUMED poisons the tensor.";
  for (int v = 0; v < kVerdictCount; ++v) g_verdicts[v] = verdict(v).release().ptr();
  m.attr("Verdict") = verdict;

  g_record_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&kRecordSpec));
  if (!g_record_type) throw py::error_already_set();
  m.attr("Record") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_record_type));
  g_entry_type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&kEntrySpec));
  if (!g_entry_type) throw py::error_already_set();
  m.attr("Entry") = py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(g_entry_type));

  m.def(
      "mark",
      [](py::object tensor, std::string file, int line, std::vector<int64_t> shape,
         std::string dtype, int64_t nbytes) -> py::object {
        // Garbage here would reach the next barrier (a None "tensor") or
        // corrupt the byte counts: refuse it where it comes in.
        if (tensor.is_none()) throw py::type_error("mark() needs a tensor, got None");
        if (nbytes < 0) throw py::value_error("mark(): nbytes must be >= 0");
        for (int64_t d : shape)
          if (d < 0) throw py::value_error("mark(): shape sizes must be >= 0");
        return RecordOrNone(GlobalLedger().Mark(std::move(tensor),
                                                std::make_shared<const std::string>(std::move(file)), line,
                                                std::move(shape), std::move(dtype), nbytes));
      },
      py::arg("tensor"), py::arg("file"), py::arg("line"), py::arg("shape"),
      py::arg("dtype"), py::arg("nbytes"),
      "Marks a tensor for the next step; None if it is already marked.");
  m.def(
      "unmark",
      [](py::object tensor) -> py::object { return RecordOrNone(GlobalLedger().Unmark(tensor)); },
      py::arg("tensor"), "Removes a pending mark; returns its record or None.");
  m.def("is_marked", [](py::object t) { return GlobalLedger().IsMarked(t); }, py::arg("tensor"));
  m.def("marked_tensors", []() { return GlobalLedger().MarkedTensors(); });
  m.def("marked_count", []() { return GlobalLedger().MarkedCount(); });
  m.def(
      "begin_step",
      []() {
        std::vector<py::object> tensors;
        std::vector<RecordPtr> records;
        int64_t step = GlobalLedger().BeginStep(&tensors, &records);
        py::list t(tensors.size()), r(records.size());
        for (size_t i = 0; i < tensors.size(); ++i) {
          PyList_SET_ITEM(t.ptr(), i, tensors[i].release().ptr());
          PyObject* rec = WrapRecord(std::move(records[i]));
          if (!rec) throw py::error_already_set();
          PyList_SET_ITEM(r.ptr(), i, rec);
        }
        return py::make_tuple(step, t, r);
      },
      "Commits all marks to a new step: (step, tensors, records).");
  m.def(
      "settle",
      [](py::handle record, py::handle verdict) {
        if (!IsRecord(record.ptr())) throw py::type_error("settle() needs a Record");
        if (!PyLong_Check(verdict.ptr())) throw py::type_error("settle() needs a Verdict");
        int v = py::cast<int>(verdict);
        if (v < 0 || v >= kVerdictCount) throw py::value_error("settle(): no such verdict");
        Verdict final_verdict = static_cast<Verdict>(v);
        if (final_verdict == Verdict::kMarked || final_verdict == Verdict::kInFlight)
          throw py::value_error("settle() needs a final verdict, got " +
                                std::string(VerdictName(final_verdict)));
        GlobalLedger().Settle(Unwrap(record.ptr()), final_verdict);
      },
      py::arg("record"), py::arg("verdict"));
  m.def("current_step", []() { return GlobalLedger().current_step(); });
  m.def(
      "step_stats",
      [](int64_t step) -> py::object {
        StepStats s;
        if (!GlobalLedger().Stats(step, &s)) return py::none();
        return StatsToDict(s);
      },
      py::arg("step") = -1);
  m.def(
      "history",
      [](int64_t since) {
        py::list out;
        for (const auto& s : GlobalLedger().History(since)) out.append(StatsToDict(s));
        return out;
      },
      py::arg("since") = 0,
      "Stats of the steps numbered `since` or later among the last HISTORY_STEPS "
      "steps that committed donations, oldest first.");
  m.def("generation", []() { return GlobalLedger().generation(); },
        "A number that changes whenever a step commits donations, a verdict is "
        "settled or the ledger is reset.");
  m.def("totals", []() { return StatsToDict(GlobalLedger().Totals()); });
  m.def("reset", []() { GlobalLedger().Reset(); });
  m.attr("HISTORY_STEPS") = Ledger::kHistorySteps;

  m.def("bind", &Bind,
        "Hands the hot path the torch / torch_xla / poison callables it needs "
        "(called by _xla.py and poison.py at import).");
  m.def(
      "set_fast_path_enabled", [](bool enabled) { g_fast_enabled = enabled; },
      py::arg("enabled"),
      "Opens try_mark's fast path while donation is switched on (config and "
      "XLA_ENABLE_PARAM_ALIASING); see module.cpp.");
  m.def(
      "note_lock", [](bool acquired) { g_lock_holders += acquired ? 1 : -1; },
      py::arg("acquired"),
      "step_hook._lock was acquired (True) or released (False): the fast path "
      "declines while anyone holds it.");
  m.def("lock_holders", []() { return g_lock_holders; });
  m.def("split_committed", &SplitCommitted, py::arg("tensors"), py::arg("records"),
        py::arg("pending"));
  m.def("poison_donors", &PoisonDonors, py::arg("donors"));
  m.def("tag_record", &TagRecordOf, py::arg("tensor"), py::arg("record"),
        "Tags the tensor's TensorImpl with its donation record.");
  m.def("tagged_record", &TaggedRecordOf, py::arg("tensor"),
        "The donation record the tensor is tagged with, or None.");
  m.def("untag_record", &UntagRecordOf, py::arg("tensor"),
        "Removes the tensor's donation record tag, if any.");
  m.def("settle_entries", &SettleEntries, py::arg("entries"), py::arg("certain"));
  if (PyModule_AddFunctions(m.ptr(), kFastMethods) < 0) throw py::error_already_set();
}
