// Scratch<T>: a per-thread vector whose capacity outlives the call.
//
// The problem: a pass over a step's donors that builds a vector of them
// asks malloc for a block of several KiB at every barrier.  glibc answers a
// request of 1 KiB or more by first merging every small block freed since
// (malloc_consolidate: the "fastbins"), so the small blocks the step's own
// tracing frees and takes again (tensors, IR nodes, their metadata) no
// longer come back from the quick lists: each large request of the plugin
// made torch's small ones dearer.  On the async loop of
// benchmarks/bench_async_instructions.py about 20 such requests a step
// cost about 1k instructions a donor on the loop's thread, most of it in
// malloc called by torch, not by the plugin (benchmarks/README.md, "Large
// blocks per step").
//
// Here: each pass takes its vectors from a per-thread cache, cleared but
// with their capacity, and gives them back when it ends.  A second user on
// the same thread while the first still holds the cached vector (a pass
// that calls Python, which reaches the same pass) gets a vector of its
// own.  A vector grown past kKeep elements is let go of rather than kept.
// The elements are destroyed where the Scratch is: one holding Python
// objects must end with the GIL held.
#pragma once

#include <cstddef>
#include <vector>

namespace torch_xla_donate {

template <class T, class Tag = void>
class Scratch {
 public:
  static constexpr size_t kKeep = size_t{1} << 16;

  Scratch() {
    Slot& slot = ThreadSlot();
    if (!slot.busy) {
      slot.busy = true;
      v_ = &slot.vector;
      cached_ = true;
    } else {
      v_ = new std::vector<T>();
    }
  }
  ~Scratch() {
    if (!cached_) {
      delete v_;
      return;
    }
    v_->clear();
    if (v_->capacity() > kKeep) std::vector<T>().swap(*v_);
    ThreadSlot().busy = false;
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  std::vector<T>& operator*() { return *v_; }
  std::vector<T>* operator->() { return v_; }
  std::vector<T>* get() { return v_; }

 private:
  struct Slot {
    std::vector<T> vector;
    bool busy = false;
  };
  static Slot& ThreadSlot() {
    static thread_local Slot slot;
    return slot;
  }

  std::vector<T>* v_;
  bool cached_ = false;
};

}  // namespace torch_xla_donate
