// The donation ledger: the single source of truth for which tensors are
// marked for the next step barrier, what each step donated, and what became
// of every donation.
//
// The ledger is deliberately ignorant of torch_xla: the Python step hook asks
// torch_xla the questions (is this tensor pending? was its buffer deleted?)
// and tells the ledger the answers.  Keeping the state here, behind one mutex,
// is what makes marks from several threads and concurrent queries safe.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "base/dims.h"
#include "base/ptr_index.h"

namespace torch_xla_donate {

namespace py = pybind11;

// What became of one donation.  Only kReused (and kLost) poison the tensor.
// The names are the reports' words (report.py).
enum class Verdict : int {
  kMarked = 0,      // waiting for the next step barrier
  kInFlight,        // the step ran; not yet known whether XLA took the buffer
  kReused,          // an output of the step now lives in the buffer
  kUnused,          // no output took the buffer; the tensor kept its value
  kUpdatedInPlace,  // updated in place after marking: it is an output itself
  kDropped,         // dropped at the commit: a holder appeared, a check could not decide
  kStepFailed,      // the step raised; the tensor kept its value
  kDisabled,        // donation is switched off; the mark was ignored
  kLost,            // the step failed, and torch_xla lost the buffer with it
  kCancelled,       // undonate() before the step (never part of a step)
};

const char* VerdictName(Verdict v);

// Which call marked a tensor: error messages name it ("donated by donate()").
enum class Via : int {
  kDonateBuffer = 0,  // donate_buffer(t), or torch_xla._XLAC.donate_buffer(t)
  kDonate,            // donate(tree)
  kDonating,          // a function wrapped with donating(...)
  kGraphOp,           // torch.ops.xla.dynamo_set_buffer_donor_ in a compiled graph
};
constexpr int kViaCount = static_cast<int>(Via::kGraphOp) + 1;

// "donate_buffer()", "donate()", ...
const char* ViaName(Via via);

// A file name shared by every record made from the same call site: a loop
// that donates thousands of tensors from one line copies no string.
using FilePtr = std::shared_ptr<const std::string>;

// A dtype's name, interned: one string per name for the life of the
// process, so that a donation records a pointer and copies no string.
using DtypeName = const std::string*;
DtypeName InternDtype(const std::string& name);
// The name of no dtype (""), without a lookup.
inline DtypeName NoDtype() {
  static const std::string* const empty = InternDtype("");
  return empty;
}

// Everything the user may want to know about one donation, also after the
// tensor is gone.  Shared by the ledger's history and the poisoned tensor.
struct Record {
  int64_t id = 0;
  int64_t step = -1;  // the step barrier that committed the mark
  FilePtr file;       // never null
  int line = 0;
  Dims shape;
  DtypeName dtype = NoDtype();  // short XLA-style name: f32, bf16, s64, pred, ...
  int64_t nbytes = 0;
  Verdict verdict = Verdict::kMarked;
  Via via = Via::kDonateBuffer;
  // The tensor's version counter when marked (-1: unknown): an in-place
  // update after marking makes it an output of the step, not a donor.
  int64_t version = -1;
  // The buffer a released or weakened entry keeps for this verdict
  // (py_types.h), type-erased: let go once the verdict is in, so that the
  // tensor, donated again, does not count it as another holder.
  std::unique_ptr<void, void (*)(void*)> held{nullptr, nullptr};

  // Updated in place since marking, given the tensor's version counter now
  // (an output of the step, not a donor).
  bool UpdatedSinceMarking(int64_t version_now) const {
    return version >= 0 && version_now != version;
  }

  // "f32[4,4]", the spelling XLA and JAX use in their messages.
  std::string ShapeString() const;
  std::string Where() const { return *file + ":" + std::to_string(line); }
};

using RecordPtr = std::shared_ptr<Record>;

// Per-step totals, kept for the last kHistorySteps steps.
struct StepStats {
  int64_t step = -1;
  int64_t donated = 0, donated_bytes = 0;
  int64_t reused = 0, reused_bytes = 0;
  int64_t unused = 0, unused_bytes = 0;
  int64_t updated_in_place = 0, updated_in_place_bytes = 0;
  // Dropped at the barrier: a view or alias appeared after marking.
  int64_t dropped = 0, dropped_bytes = 0;
  int64_t failed = 0, failed_bytes = 0;  // the step failed; values kept
  int64_t lost = 0, lost_bytes = 0;      // the step failed and lost them
  int64_t steps = 0;                     // in the totals: how many steps committed donations
  std::vector<std::string> unused_shapes;
  bool settled() const { return in_flight == 0; }
  int64_t in_flight = 0;  // donations of this step without a final verdict
};

class Ledger {
 public:
  static constexpr size_t kHistorySteps = 64;

  // Marks `tensor` for the next step, its record in `record` if given.
  // False when it is already marked: marking twice before a step counts
  // once.
  bool Mark(py::object tensor, FilePtr file, int line, Dims shape, DtypeName dtype, int64_t nbytes,
            Via via = Via::kDonateBuffer, int64_t version = -1, RecordPtr* record = nullptr);

  // Removes a pending mark; returns its record (verdict kCancelled) or
  // nullptr when the tensor was not marked.
  RecordPtr Unmark(const py::handle& tensor);

  bool IsMarked(const py::handle& tensor) const;
  std::vector<py::object> MarkedTensors() const;
  size_t MarkedCount() const;

  // Commits every pending mark to a new step and returns them in marking
  // order.  The ledger keeps no reference to the tensors afterwards.  With
  // `only`, commits just the marks of those tensors (an execution that sees
  // part of the marks: one device's barrier, one compiled graph's inputs);
  // the others stay marked, in their order.
  int64_t BeginStep(std::vector<py::object>* tensors, std::vector<RecordPtr>* records,
                    const std::vector<PyObject*>* only = nullptr);

  // Records the final verdict of one donation of a committed step.
  void Settle(const RecordPtr& record, Verdict verdict);
  // The same verdict for each of `records`, under one hold of the lock (a
  // settle pass over a step's donors).
  void SettleAll(const std::vector<Record*>& records, Verdict verdict);

  int64_t current_step() const;
  // Stats of `step`, or of the newest step when step < 0.  False if unknown.
  bool Stats(int64_t step, StepStats* out) const;
  StepStats Totals() const;
  // The stats of the steps in the history window numbered `since` or
  // later, oldest first.
  std::vector<StepStats> History(int64_t since = 0) const;
  // Changes whenever a step commits donations, a verdict is settled or the
  // ledger is reset: observers poll it to skip work when nothing happened.
  int64_t generation() const;
  void Reset();

 private:
  struct Mark_ {
    py::object tensor;
    RecordPtr record;
  };
  StepStats* FindStatsLocked(int64_t step);
  // Settle's work, the lock held; what the record held moves to `held`.
  void SettleLocked(Record* record, Verdict verdict, std::unique_ptr<void, void (*)(void*)>* held);
  void CompactLocked();  // drops the tombstones Unmark leaves in marks_

  mutable std::mutex mu_;
  int64_t next_id_ = 1;
  int64_t step_ = 0;  // number of step barriers that committed marks
  int64_t generation_ = 0;
  std::vector<Mark_> marks_;  // in marking order; unmarked slots are empty
  PtrIndex index_;            // tensor -> slot in marks_
  std::deque<StepStats> history_;
  StepStats totals_;
};

Ledger& GlobalLedger();

}  // namespace torch_xla_donate
