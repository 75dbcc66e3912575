// What the native module's files share: the enums' lists, the ledger, its records' Python faces.
#pragma once

#include <Python.h>
#include <c10/util/SmallVector.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch_xla_donate {

namespace py = pybind11;

// Each list is declared here once; module.cpp makes the Python enums from them.
// clang-format off
#define TDX_VERDICTS(X)                                                                     \
  X(MARKED) X(IN_FLIGHT) X(REUSED) X(UNUSED) X(UPDATED_IN_PLACE) X(DROPPED) X(STEP_FAILED) \
  X(DISABLED) X(LOST) X(CANCELLED)
#define TDX_VIAS(X) X(DONATE_BUFFER) X(DONATE) X(DONATING) X(GRAPH_OP)
// Why a tensor is not marked (marking.cpp Classify).
#define TDX_REFUSALS(X)                                                                    \
  X(NONE) X(NOT_TENSOR) X(WRAPPER) X(POISONED) X(NEW_CLASS) X(NOT_XLA) X(VIEW) X(ZERO_DIM) \
  X(OFF) X(UNDECIDED) X(WARN_FIRST) X(COMMITTING) X(PENDING) X(COPY) X(HELD)
// What the commit made of a mark (commit.cpp Split).
#define TDX_SPLITS(X) X(DONOR) X(HELD) X(COPY) X(EXCESS) X(UNREAD)
// A step's counters, each a count and its bytes (StepStats).
#define TDX_COUNTERS(X) X(donated) X(reused) X(unused) X(updated_in_place) X(dropped) X(failed) X(lost)
// clang-format on

#define TDX_MEMBER(name) name,
enum class Verdict : int { TDX_VERDICTS(TDX_MEMBER) };
enum class Via : int { TDX_VIAS(TDX_MEMBER) };
enum class Refusal : int { TDX_REFUSALS(TDX_MEMBER) };
enum class Split : int { TDX_SPLITS(TDX_MEMBER) };
#undef TDX_MEMBER
constexpr int kViaCount = static_cast<int>(Via::GRAPH_OP) + 1;
constexpr int kVerdictCount = static_cast<int>(Verdict::CANCELLED) + 1;

// Raises pybind11::error_already_set unless `ok` (a Python error is set).
inline void Check(bool ok) {
  if (!ok) throw py::error_already_set();
}

// The heap types (entry.cpp, trampoline.cpp), and the end of their instances' dealloc.
inline PyTypeObject* NewType(const char* name, size_t size, PyType_Slot* slots, unsigned flags) {
  PyType_Spec spec = {name, static_cast<int>(size), 0, flags, slots};
  auto* type = reinterpret_cast<PyTypeObject*>(PyType_FromSpec(&spec));
  Check(type != nullptr);
  return type;
}
inline void FreeInstance(PyObject* self) {
  PyTypeObject* type = Py_TYPE(self);
  type->tp_free(self);
  Py_DECREF(type);
}

// A vector this thread keeps between calls, cleared, capacity kept: a step's
// vectors of donors would each ask malloc for a block of 1 KiB or more, which
// makes glibc consolidate every small block freed since (benchmarks/README.md,
// "Native optimizations").  A nested use of the same Tag just allocates.
template <class T, int Tag = 0>
class Scratch {
 public:
  Scratch() { v_.swap(Cache()); }
  ~Scratch() {
    v_.clear();
    if (v_.capacity() > Cache().capacity()) Cache().swap(v_);
  }
  std::vector<T>& operator*() { return v_; }
  std::vector<T>* operator->() { return &v_; }

 private:
  static std::vector<T>& Cache() {
    thread_local std::vector<T> cache;
    return cache;
  }
  std::vector<T> v_;
};

using Dims = c10::SmallVector<int64_t, 6>;           // no allocation per record for most shapes
using FilePtr = std::shared_ptr<const std::string>;  // shared by a call site's records
using DtypeName = const std::string*;                // interned: f32, bf16, pred, ...
DtypeName InternDtype(const std::string& name);

// One donation, also after its tensor is gone (the ledger's history and a poisoned tensor's tag).
struct Record {
  int64_t id = 0;
  int64_t step = -1;  // the execution that committed it
  FilePtr file;
  int line = 0;
  Dims shape;
  DtypeName dtype = nullptr;
  int64_t nbytes = 0;
  Verdict verdict = Verdict::MARKED;
  Via via = Via::DONATE_BUFFER;
  int64_t version = -1;  // the version counter when marked (-1: none kept)
  // The buffer (a BackendDataPtr) a released or weakened entry keeps until the verdict, and the
  // weakened entry, for its tensor's finalizer (entry.cpp).
  std::shared_ptr<void> held;
  void* weak_entry = nullptr;

  std::string ShapeString() const;  // "f32[4,4]"
};
using RecordPtr = std::shared_ptr<Record>;

struct StepStats {
#define TDX_FIELDS(name) int64_t name = 0, name##_bytes = 0;
  TDX_COUNTERS(TDX_FIELDS)
#undef TDX_FIELDS
  int64_t step = -1;
  int64_t steps = 0;      // in the totals: the steps that committed donations
  int64_t in_flight = 0;  // donations of the step without a final verdict
  std::vector<std::string> unused_shapes;
};

// The marks waiting for an execution, and what became of each donation.  Thread-safe; no Python.
class Ledger {
 public:
  static constexpr size_t kHistorySteps = 64;
  // False when `tensor` is marked already (twice before a step counts once).
  bool Mark(py::object tensor, RecordPtr record);
  RecordPtr Unmark(const py::handle& tensor);  // CANCELLED, or null if not marked
  bool IsMarked(const py::handle& tensor) const;
  std::vector<py::object> MarkedTensors() const;
  size_t MarkedCount() const;
  // Takes the marks (all, or those of `only`) into a new step, IN_FLIGHT, in marking order.
  int64_t BeginStep(std::vector<py::object>* tensors, std::vector<RecordPtr>* records,
                    const std::vector<PyObject*>* only = nullptr);
  // The final verdict of an IN_FLIGHT record (settled once only).
  void Settle(Record* record, Verdict verdict);
  void SettleAll(const std::vector<Record*>& records, Verdict verdict);
  int64_t current_step() const;
  bool Stats(int64_t step, StepStats* out) const;  // step < 0: the newest
  StepStats Totals() const;
  std::vector<StepStats> History(int64_t since) const;
  int64_t generation() const;  // changes with every commit and verdict
  void Reset();

 private:
  struct Slot {
    py::object tensor;
    RecordPtr record;  // null: unmarked since
  };
  void CompactLocked();
  StepStats* FindLocked(int64_t step);

  mutable std::mutex mu_;
  int64_t next_id_ = 1, step_ = 0, generation_ = 0;
  std::vector<Slot> marks_, spare_;                // spare_: a block kept for the next step's marks
  std::unordered_map<const void*, size_t> index_;  // tensor -> its slot
  std::deque<StepStats> history_;
  StepStats totals_;
};
Ledger& GlobalLedger();
RecordPtr NewRecord();

// -- entry.cpp: `_C.Record` wraps a RecordPtr; `_C.Entry` is a committed donor's (tensor, record),
// untracked by the GC; released, it keeps only the buffer; weakened, also a weak tensor reference.
PyObject* WrapRecord(RecordPtr record);   // new reference, or null with an error
const RecordPtr& RecordArg(PyObject* o);  // throws py::type_error for no Record
PyObject* NewEntry(PyObject* tensor, const RecordPtr& record);
// An Entry's or (tensor, Record) tuple's borrowed tensor (None once released) and record.
bool EntryParts(PyObject* o, PyObject** tensor, const RecordPtr** record);
using HeldBuffer = std::shared_ptr<void>;  // a BackendDataPtr (reads.h: TakeBuffer)
bool ReleaseEntryTensor(PyObject* entry, HeldBuffer* buffer);  // takes `buffer` if true
bool WeakenEntryTensor(PyObject* entry, HeldBuffer* buffer);   // takes `buffer` if true
void EntryLetGoOfDead(PyObject* entry);                        // a weakened entry whose tensor died
void WeakenedTensorDying(uintptr_t impl, Record* record);      // from a poisoned tensor's finalizer
const HeldBuffer* EntryBuffer(PyObject* entry);                // null: keeps none, or settled
bool EntryTensorAlive(PyObject* entry);  // its tensor still leads to its buffer
void RegisterEntries(py::module_& m);

// Python objects bound at import (`_C.bind`, _native.py).
struct Hooks {
  PyObject* tensor_type = nullptr;          // torch.Tensor
  PyObject* donated_type = nullptr;         // _poison.Donated, the poisoned twins' mixin
  PyObject* on_donated_dispatch = nullptr;  // an operator met a donated tensor (poison.cpp)
  PyObject* on_refusal = nullptr;           // donate_buffer refused a tensor (marking.cpp)
};
extern Hooks g_hooks;
void RequireBound();  // throws unless the package bound every hook

}  // namespace torch_xla_donate
