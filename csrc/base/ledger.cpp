#include "base/ledger.h"

#include <mutex>
#include <string>
#include <unordered_set>
#include <utility>

#include "base/block_pool.h"
#include "base/scratch.h"

namespace torch_xla_donate {

const char* VerdictName(Verdict v) {
  switch (v) {
    case Verdict::kMarked:
      return "marked";
    case Verdict::kInFlight:
      return "in_flight";
    case Verdict::kReused:
      return "reused";
    case Verdict::kUnused:
      return "unused";
    case Verdict::kUpdatedInPlace:
      return "updated_in_place";
    case Verdict::kDropped:
      return "dropped";
    case Verdict::kStepFailed:
      return "step_failed";
    case Verdict::kDisabled:
      return "disabled";
    case Verdict::kLost:
      return "lost";
    case Verdict::kCancelled:
      return "cancelled";
  }
  return "unknown";
}

const char* ViaName(Via via) {
  switch (via) {
    case Via::kDonateBuffer:
      return "donate_buffer()";
    case Via::kDonate:
      return "donate()";
    case Via::kDonating:
      return "a donating() function";
    case Via::kGraphOp:
      return "torch.ops.xla.dynamo_set_buffer_donor_()";
  }
  return "donate_buffer()";
}

DtypeName InternDtype(const std::string& name) {
  // Never freed: records may outlive static destructors at exit.
  static auto* mu = new std::mutex();
  static auto* names = new std::unordered_set<std::string>();
  std::lock_guard<std::mutex> lock(*mu);
  return &*names->insert(name).first;
}

std::string Record::ShapeString() const {
  std::string s = *dtype + "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ",";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

bool Ledger::Mark(py::object tensor, FilePtr file, int line, Dims shape, DtypeName dtype,
                  int64_t nbytes, Via via, int64_t version, RecordPtr* out) {
  std::lock_guard<std::mutex> lock(mu_);
  PyObject* key = tensor.ptr();
  if (index_.Find(key)) return false;
  auto record = std::allocate_shared<Record>(PoolAllocator<Record>());
  record->id = next_id_++;
  record->file = std::move(file);
  record->line = line;
  record->shape = std::move(shape);
  record->dtype = dtype;
  record->nbytes = nbytes;
  record->via = via;
  record->version = version;
  if (out) *out = record;
  index_.Set(key, marks_.size());
  marks_.push_back(Mark_{std::move(tensor), std::move(record)});
  return true;
}

RecordPtr Ledger::Unmark(const py::handle& tensor) {
  Mark_ removed;  // destroyed after the lock is released (see below)
  {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t* found = index_.Find(tensor.ptr());
    if (!found) return nullptr;
    size_t slot = *found;
    index_.Erase(tensor.ptr());
    // Leave an empty slot (a tombstone) so that the other slots, and marking
    // order, stay as they are: undoing many marks (an all-or-nothing pytree
    // donation that failed) stays linear.  Compact once tombstones dominate.
    removed = std::move(marks_[slot]);
    marks_[slot] = Mark_{};
    if (marks_.size() > 64 && index_.size() < marks_.size() / 2) CompactLocked();
    removed.record->verdict = Verdict::kCancelled;
  }
  // Dropping the last reference to a tensor can run arbitrary Python code
  // (weakref callbacks); that must never happen while mu_ is held.
  return removed.record;
}

bool Ledger::IsMarked(const py::handle& tensor) const {
  std::lock_guard<std::mutex> lock(mu_);
  return index_.Find(tensor.ptr()) != nullptr;
}

std::vector<py::object> Ledger::MarkedTensors() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<py::object> out;
  out.reserve(marks_.size());
  for (const auto& m : marks_)
    if (m.record) out.push_back(m.tensor);
  return out;
}

size_t Ledger::MarkedCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  return index_.size();
}

void Ledger::CompactLocked() {
  size_t live = 0;
  for (size_t i = 0; i < marks_.size(); ++i) {
    if (!marks_[i].record) continue;  // tombstones hold no tensor: no decref
    if (live != i) marks_[live] = std::move(marks_[i]);
    index_.Set(marks_[live].tensor.ptr(), live);
    ++live;
  }
  marks_.resize(live);
}

int64_t Ledger::BeginStep(std::vector<py::object>* tensors, std::vector<RecordPtr>* records,
                          const std::vector<PyObject*>* only) {
  // The thread's scratch (base/scratch.h): swapped with marks_, it leaves
  // marks_ empty with a step's capacity.
  Scratch<Mark_> taken;
  std::vector<Mark_>& marks = *taken;
  int64_t step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    step = ++step_;
    if (only == nullptr) {
      marks.swap(marks_);
      index_.Clear();
    } else {
      // Take the listed marks out, leaving tombstones (as Unmark does).
      marks.reserve(only->size());
      for (PyObject* key : *only) {
        const size_t* found = index_.Find(key);
        if (!found) continue;
        size_t slot = *found;
        index_.Erase(key);
        marks.push_back(std::move(marks_[slot]));
        marks_[slot] = Mark_{};
      }
      if (index_.size() == 0) {
        marks_.clear();
      } else if (marks_.size() > 64 && index_.size() < marks_.size() / 2) {
        CompactLocked();
      }
    }
    StepStats stats;
    stats.step = step;
    for (auto& m : marks) {
      if (!m.record) continue;  // unmarked: a tombstone
      m.record->step = step;
      m.record->verdict = Verdict::kInFlight;
      stats.donated += 1;
      stats.donated_bytes += m.record->nbytes;
    }
    stats.in_flight = stats.donated;
    totals_.donated += stats.donated;
    totals_.donated_bytes += stats.donated_bytes;
    if (stats.donated) {
      stats.steps = 1;
      totals_.steps += 1;
      ++generation_;
      history_.push_back(std::move(stats));
      while (history_.size() > kHistorySteps) history_.pop_front();
    }
  }
  tensors->reserve(marks.size());
  records->reserve(marks.size());
  for (auto& m : marks) {
    if (!m.record) continue;
    tensors->push_back(std::move(m.tensor));
    records->push_back(std::move(m.record));
  }
  return step;
}

StepStats* Ledger::FindStatsLocked(int64_t step) {
  for (auto it = history_.rbegin(); it != history_.rend(); ++it)
    if (it->step == step) return &*it;
  return nullptr;  // older than the history window: only totals count it
}

void Ledger::Settle(const RecordPtr& record, Verdict verdict) {
  std::unique_ptr<void, void (*)(void*)> held{nullptr, nullptr};  // let go after the lock
  std::lock_guard<std::mutex> lock(mu_);
  SettleLocked(record.get(), verdict, &held);
}

void Ledger::SettleAll(const std::vector<Record*>& records, Verdict verdict) {
  // Let go of after the lock; the thread's scratch (base/scratch.h).
  Scratch<std::unique_ptr<void, void (*)(void*)>> held;
  held->reserve(records.size());
  std::lock_guard<std::mutex> lock(mu_);
  for (Record* record : records) {
    held->emplace_back(nullptr, nullptr);
    SettleLocked(record, verdict, &held->back());
  }
}

void Ledger::SettleLocked(Record* record, Verdict verdict,
                          std::unique_ptr<void, void (*)(void*)>* held) {
  if (record->verdict != Verdict::kInFlight) return;  // settled once only
  record->verdict = verdict;
  *held = std::move(record->held);
  ++generation_;
  StepStats* stats = FindStatsLocked(record->step);
  for (StepStats* s : {stats, &totals_}) {
    if (!s) continue;
    switch (verdict) {
      case Verdict::kReused:
        s->reused += 1;
        s->reused_bytes += record->nbytes;
        break;
      case Verdict::kUnused:
        s->unused += 1;
        s->unused_bytes += record->nbytes;
        if (s != &totals_) s->unused_shapes.push_back(record->ShapeString());
        break;
      case Verdict::kUpdatedInPlace:
        s->updated_in_place += 1;
        s->updated_in_place_bytes += record->nbytes;
        break;
      case Verdict::kDropped:  // only a commit settles a mark so
        s->dropped += 1;       // (undonate() before the step never does)
        s->dropped_bytes += record->nbytes;
        break;
      case Verdict::kStepFailed:
      case Verdict::kDisabled:
        s->failed += 1;
        s->failed_bytes += record->nbytes;
        break;
      case Verdict::kLost:
        s->lost += 1;
        s->lost_bytes += record->nbytes;
        break;
      default:
        break;
    }
  }
  if (stats && stats->in_flight > 0) stats->in_flight -= 1;
}

int64_t Ledger::current_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return step_;
}

bool Ledger::Stats(int64_t step, StepStats* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (history_.empty()) return false;
  if (step < 0) {
    *out = history_.back();
    return true;
  }
  for (const auto& s : history_)
    if (s.step == step) {
      *out = s;
      return true;
    }
  return false;
}

StepStats Ledger::Totals() const {
  std::lock_guard<std::mutex> lock(mu_);
  return totals_;
}

std::vector<StepStats> Ledger::History(int64_t since) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto first = history_.begin();
  while (first != history_.end() && first->step < since) ++first;
  return std::vector<StepStats>(first, history_.end());
}

int64_t Ledger::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

void Ledger::Reset() {
  std::vector<Mark_> dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dropped.swap(marks_);
    index_.Clear();
    history_.clear();
    totals_ = StepStats();
    ++generation_;
  }
}

Ledger& GlobalLedger() {
  // Leaked on purpose: it holds Python objects, and destroying them after
  // the interpreter has shut down would crash at exit.
  static Ledger* ledger = new Ledger();
  return *ledger;
}

}  // namespace torch_xla_donate
