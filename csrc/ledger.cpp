// The ledger: marks waiting for an execution, per-step counters, verdicts.
#include <unordered_set>

#include "common.h"

namespace torch_xla_donate {

DtypeName InternDtype(const std::string& name) {
  // Never freed: records may outlive static destructors at exit.
  static auto* mu = new std::mutex();
  static auto* names = new std::unordered_set<std::string>();
  std::lock_guard<std::mutex> lock(*mu);
  return &*names->insert(name).first;
}

std::string Record::ShapeString() const {
  std::string s = (dtype ? *dtype : std::string()) + "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s + "]";
}

namespace {
// Records come from a bounded free list, never freed: a step makes more than malloc's cache keeps.
struct RecordBlocks {
  std::mutex mu;
  std::vector<void*> free;
  size_t size = 0;  // the one block size allocate_shared asks for
};
RecordBlocks& Blocks() {
  static auto* blocks = [] {
    auto* b = new RecordBlocks();
    b->free.reserve(4096);
    return b;
  }();
  return *blocks;
}

template <class T>
struct RecordAllocator {
  using value_type = T;
  RecordAllocator() = default;
  template <class U>
  RecordAllocator(const RecordAllocator<U>&) {}
  T* allocate(size_t n) {
    RecordBlocks& b = Blocks();
    const size_t bytes = n * sizeof(T);
    {
      std::lock_guard<std::mutex> lock(b.mu);
      if (b.size == 0) b.size = bytes;
      if (bytes == b.size && !b.free.empty()) {
        void* p = b.free.back();
        b.free.pop_back();
        return static_cast<T*>(p);
      }
    }
    return static_cast<T*>(::operator new(bytes));
  }
  void deallocate(T* p, size_t n) {
    RecordBlocks& b = Blocks();
    {
      std::lock_guard<std::mutex> lock(b.mu);
      if (n * sizeof(T) == b.size && b.free.size() < 4096) {
        b.free.push_back(p);
        return;
      }
    }
    ::operator delete(p);
  }
  template <class U>
  bool operator==(const RecordAllocator<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const RecordAllocator<U>&) const {
    return false;
  }
};
}  // namespace

RecordPtr NewRecord() { return std::allocate_shared<Record>(RecordAllocator<Record>()); }

bool Ledger::Mark(py::object tensor, RecordPtr record) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!index_.emplace(tensor.ptr(), marks_.size()).second) return false;
  record->id = next_id_++;
  marks_.push_back(Slot{std::move(tensor), std::move(record)});
  return true;
}

RecordPtr Ledger::Unmark(const py::handle& tensor) {
  Slot removed;  // dropped after the lock: a tensor's death may run Python code
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(tensor.ptr());
    if (it == index_.end()) return nullptr;
    // A tombstone keeps the other slots (and marking order) where they are.
    removed = std::move(marks_[it->second]);
    marks_[it->second] = Slot{};
    index_.erase(it);
    CompactLocked();
    removed.record->verdict = Verdict::CANCELLED;
  }
  return removed.record;
}

void Ledger::CompactLocked() {
  if (marks_.size() <= 64 || index_.size() >= marks_.size() / 2) return;
  size_t live = 0;
  for (Slot& slot : marks_) {
    if (!slot.record) continue;
    index_[slot.tensor.ptr()] = live;
    marks_[live++] = std::move(slot);
  }
  marks_.resize(live);
}

bool Ledger::IsMarked(const py::handle& tensor) const {
  std::lock_guard<std::mutex> lock(mu_);
  return index_.count(tensor.ptr()) != 0;
}

std::vector<py::object> Ledger::MarkedTensors() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<py::object> out;
  for (const Slot& slot : marks_)
    if (slot.record) out.push_back(slot.tensor);
  return out;
}

size_t Ledger::MarkedCount() const {
  std::lock_guard<std::mutex> lock(mu_);
  return index_.size();
}

int64_t Ledger::BeginStep(std::vector<py::object>* tensors, std::vector<RecordPtr>* records,
                          const std::vector<PyObject*>* only) {
  std::vector<Slot> taken;
  int64_t step;
  {
    std::lock_guard<std::mutex> lock(mu_);
    step = ++step_;
    if (only == nullptr) {
      taken.swap(marks_);
      marks_.swap(spare_);  // last step's block: the next step marks as many
      index_.clear();
    } else {
      for (PyObject* key : *only) {
        auto it = index_.find(key);
        if (it == index_.end()) continue;
        taken.push_back(std::move(marks_[it->second]));
        marks_[it->second] = Slot{};
        index_.erase(it);
      }
      if (index_.empty()) marks_.clear();
      CompactLocked();
    }
    StepStats stats;
    stats.step = step;
    for (Slot& slot : taken) {
      if (!slot.record) continue;  // a tombstone
      slot.record->step = step;
      slot.record->verdict = Verdict::IN_FLIGHT;
      stats.donated += 1;
      stats.donated_bytes += slot.record->nbytes;
    }
    if (stats.donated) {
      stats.in_flight = stats.donated;
      stats.steps = 1;
      totals_.donated += stats.donated;
      totals_.donated_bytes += stats.donated_bytes;
      totals_.steps += 1;
      ++generation_;
      history_.push_back(std::move(stats));
      if (history_.size() > kHistorySteps) history_.pop_front();
    }
  }
  tensors->reserve(taken.size());
  records->reserve(taken.size());
  for (Slot& slot : taken) {
    if (!slot.record) continue;
    tensors->push_back(std::move(slot.tensor));
    records->push_back(std::move(slot.record));
  }
  taken.clear();
  std::lock_guard<std::mutex> lock(mu_);
  if (taken.capacity() > spare_.capacity()) spare_.swap(taken);
  return step;
}

StepStats* Ledger::FindLocked(int64_t step) {
  for (auto it = history_.rbegin(); it != history_.rend(); ++it)
    if (it->step == step) return &*it;
  return nullptr;  // older than the history: only the totals count it
}

namespace {
// The counter a final verdict adds to (DISABLED counts as failed: values kept).
int64_t* CounterOf(StepStats* s, Verdict v, int64_t** bytes) {
  switch (v) {
#define TDX_CASE(verdict, name) \
  case Verdict::verdict:        \
    *bytes = &s->name##_bytes;  \
    return &s->name;
    TDX_CASE(REUSED, reused)
    TDX_CASE(UNUSED, unused)
    TDX_CASE(UPDATED_IN_PLACE, updated_in_place)
    TDX_CASE(DROPPED, dropped)
    TDX_CASE(STEP_FAILED, failed)
    TDX_CASE(DISABLED, failed)
    TDX_CASE(LOST, lost)
#undef TDX_CASE
    default:
      return nullptr;
  }
}
}  // namespace

void Ledger::Settle(Record* record, Verdict verdict) { SettleAll({record}, verdict); }

void Ledger::SettleAll(const std::vector<Record*>& records, Verdict verdict) {
  Scratch<HeldBuffer> scratch;  // let go after the lock
  auto& held = *scratch;
  std::lock_guard<std::mutex> lock(mu_);
  for (Record* record : records) {
    if (record->verdict != Verdict::IN_FLIGHT) continue;  // settled once only
    record->verdict = verdict;
    if (record->held) held.push_back(std::move(record->held));
    ++generation_;
    StepStats* stats = FindLocked(record->step);
    for (StepStats* s : {stats, &totals_}) {
      int64_t* bytes;
      int64_t* count = s ? CounterOf(s, verdict, &bytes) : nullptr;
      if (!count) continue;
      *count += 1;
      *bytes += record->nbytes;
      if (verdict == Verdict::UNUSED && s != &totals_)
        s->unused_shapes.push_back(record->ShapeString());
    }
    if (stats && stats->in_flight > 0) stats->in_flight -= 1;
  }
}

int64_t Ledger::current_step() const {
  std::lock_guard<std::mutex> lock(mu_);
  return step_;
}

bool Ledger::Stats(int64_t step, StepStats* out) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = history_.rbegin(); it != history_.rend(); ++it) {
    if (step >= 0 && it->step != step) continue;
    *out = *it;
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
  std::vector<StepStats> out;
  for (const StepStats& s : history_)
    if (s.step >= since) out.push_back(s);
  return out;
}

int64_t Ledger::generation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return generation_;
}

void Ledger::Reset() {
  std::vector<Slot> dropped;  // after the lock
  std::lock_guard<std::mutex> lock(mu_);
  dropped.swap(marks_);
  index_.clear();
  history_.clear();
  totals_ = StepStats();
  ++generation_;
}

Ledger& GlobalLedger() {
  static Ledger* ledger = new Ledger();  // leaked: it holds Python objects past exit
  return *ledger;
}

}  // namespace torch_xla_donate
