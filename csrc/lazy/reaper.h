// Frees consumed device-buffer objects off the training loop's thread.
//
// The problem: raw donation lets go of a donated input's buffer object
// (torch_xla's PjRtData, about 1.3k instructions to destroy) on the thread
// that ran the execution, once it finished.  A verdict must read that
// buffer after the execution, so the plugin keeps one reference to it
// (lazy_reads.h HeldBuffer) until the next barrier settles the donation,
// and that barrier, on the loop's own thread, destroyed it: 400 donors
// cost the loop about half a millisecond a step that raw donation spends
// on another core.
//
// Here: a consumed buffer's holder goes to one background thread, handed
// over in batches (one wake-up per settle pass, not one per buffer).  Only
// consumed buffers: they hold no device memory, so when they are freed
// changes no peak; a buffer that still holds a value (an unused donation)
// is freed at once, where it was before.  The thread only runs C++
// destructors, never Python, and holds no lock of the caller's.
//
// Process life: at exit (atexit, _base/native.py) the queue is drained and
// every later drop is freed at once; a forked child starts with an empty
// queue and no thread (the parent's buffers are not the child's to free),
// and starts its own on first use.
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>

namespace torch_xla_donate {

// Frees `object` with `destroy` on the background thread, at the next
// handover (ReapHandOver), or at once when the reaper is stopped.  Callable
// from any thread.
void ReapLater(void* object, void (*destroy)(void*));

// While one is open on a thread, that thread's ReapLater calls collect
// their objects without taking the reaper's lock, and Close (or the
// destructor) queues them all under one hold of it: a settle pass lets go
// of a buffer per donor.  Nested batches join the outermost.
class ReapBatch {
 public:
  ReapBatch();
  ~ReapBatch() { Close(); }
  ReapBatch(const ReapBatch&) = delete;
  ReapBatch& operator=(const ReapBatch&) = delete;
  void Close();

 private:
  bool open_;
};

// Hands what ReapLater collected to the thread when there is enough of it
// to be worth a wake-up (or `always`).  Cheap when there is nothing.
void ReapHandOver(bool always = false);

// Frees everything queued, on the calling thread's behalf (waits for the
// thread), and with `stop` frees every later object at once.
void ReapDrain(bool stop);

struct ReaperStats {
  uint64_t queued = 0;   // objects given to ReapLater
  uint64_t reaped = 0;   // ... freed by the background thread
  uint64_t inline_ = 0;  // ... freed on the caller's thread (stopped, drained)
  size_t pending = 0;    // ... not freed yet
  bool stopped = false;
};
ReaperStats GetReaperStats();

// Registers reaper_hand_over, reaper_drain and reaper_stats on `module`.
void RegisterReaper(PyObject* module);

}  // namespace torch_xla_donate
