// See reaper.h.
#include "lazy/reaper.h"

#include <pthread.h>
#include <pybind11/pybind11.h>

#include <condition_variable>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

struct Item {
  void* object;
  void (*destroy)(void*);
};

// A handover smaller than this waits for the next one: a wake-up costs a
// system call, more than freeing a few objects here.
constexpr size_t kBatch = 32;

// Heap-allocated and never freed: the thread may still wait on them while
// static destructors run at exit.
struct Reaper {
  std::mutex mu;
  std::condition_variable wake, idle;
  std::vector<Item> collected;  // since the last handover
  std::vector<Item> handed;     // the thread's to free
  bool running = false;         // the thread exists (in this process)
  bool busy = false;            // the thread is freeing a batch
  bool stopped = false;
  ReaperStats stats;
};

Reaper* g_reaper = new Reaper();

void Run(Reaper* r) {
  std::vector<Item> batch;
  std::unique_lock<std::mutex> lock(r->mu);
  for (;;) {
    r->wake.wait(lock, [r] { return !r->handed.empty(); });
    batch.swap(r->handed);
    r->busy = true;
    lock.unlock();
    for (const Item& item : batch) item.destroy(item.object);
    lock.lock();
    r->stats.reaped += batch.size();
    r->stats.pending -= batch.size();
    batch.clear();
    r->busy = false;
    r->idle.notify_all();
  }
}

// A forked child: the thread is not there, and the queued objects are the
// parent's.  Forgotten (not freed), with a fresh lock.
void AfterForkInChild() { g_reaper = new Reaper(); }

void StartLocked(Reaper* r) {
  if (r->running) return;
  static bool fork_handler = (pthread_atfork(nullptr, nullptr, AfterForkInChild), true);
  (void)fork_handler;
  std::thread(Run, r).detach();
  r->running = true;
}

void FreeNow(std::vector<Item>* items) {
  for (const Item& item : *items) item.destroy(item.object);
  items->clear();
}

}  // namespace

// The open ReapBatch of this thread (its depth) and what it collected.
static thread_local int t_batch_depth = 0;
static thread_local std::vector<Item> t_batch;

ReapBatch::ReapBatch() : open_(true) { ++t_batch_depth; }

void ReapBatch::Close() {
  if (!open_) return;
  open_ = false;
  if (--t_batch_depth > 0 || t_batch.empty()) return;
  Reaper* r = g_reaper;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (!r->stopped) {
      // Copied, not swapped: the batch keeps its capacity for the next
      // pass (base/scratch.h says why a block per step is dear).
      r->collected.insert(r->collected.end(), t_batch.begin(), t_batch.end());
      r->stats.queued += t_batch.size();
      r->stats.pending += t_batch.size();
      t_batch.clear();
      return;
    }
    r->stats.inline_ += t_batch.size();
  }
  // The reaper stopped meanwhile: freed here, as ReapLater would (from a
  // vector of its own: a destructor may call ReapLater).
  std::vector<Item> items;
  items.swap(t_batch);
  FreeNow(&items);
}

void ReapLater(void* object, void (*destroy)(void*)) {
  if (t_batch_depth > 0) {
    t_batch.push_back({object, destroy});
    return;
  }
  Reaper* r = g_reaper;
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (!r->stopped) {
      r->collected.push_back({object, destroy});
      ++r->stats.queued;
      ++r->stats.pending;
      return;
    }
    ++r->stats.inline_;
  }
  destroy(object);
}

void ReapHandOver(bool always) {
  Reaper* r = g_reaper;
  std::lock_guard<std::mutex> lock(r->mu);
  if (r->collected.empty() || (!always && r->collected.size() < kBatch)) return;
  if (r->handed.empty()) {
    r->handed.swap(r->collected);
  } else {
    r->handed.insert(r->handed.end(), r->collected.begin(), r->collected.end());
    r->collected.clear();
  }
  StartLocked(r);
  r->wake.notify_one();
}

void ReapDrain(bool stop) {
  Reaper* r = g_reaper;
  std::vector<Item> mine;
  {
    std::unique_lock<std::mutex> lock(r->mu);
    if (stop) r->stopped = true;
    mine.swap(r->collected);
    if (r->running) r->idle.wait(lock, [r] { return r->handed.empty() && !r->busy; });
    r->stats.inline_ += mine.size();
    r->stats.pending -= mine.size();
  }
  FreeNow(&mine);
}

ReaperStats GetReaperStats() {
  Reaper* r = g_reaper;
  std::lock_guard<std::mutex> lock(r->mu);
  ReaperStats out = r->stats;
  out.stopped = r->stopped;
  return out;
}

void RegisterReaper(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  m.def(
      "reaper_hand_over", [](bool always) { ReapHandOver(always); }, py::arg("always") = true,
      "Hands the consumed buffers collected so far to the background thread.");
  m.def(
      "reaper_drain",
      [](bool stop) {
        py::gil_scoped_release no_gil;  // the thread never takes it; waiting must not hold it
        ReapDrain(stop);
      },
      py::arg("stop") = false,
      "Waits until every queued buffer is freed; with `stop`, frees later ones at once "
      "(at exit).");
  m.def("reaper_stats", []() {
    const ReaperStats s = GetReaperStats();
    py::dict out;
    out["queued"] = s.queued;
    out["reaped"] = s.reaped;
    out["inline"] = s.inline_;
    out["pending"] = s.pending;
    out["stopped"] = s.stopped;
    return out;
  });
}

}  // namespace torch_xla_donate
