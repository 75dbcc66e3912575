// BlockPool: recycled memory for the small objects a step makes per donor
// (its Record, the buffer a verdict keeps, a poisoned tensor's record tag).
//
// The problem: a loop donating 400 tensors makes 400 of each in a burst at
// marking or at the barrier, and frees them in a burst a step later.  glibc
// keeps only 7 freed blocks per size in its per-thread cache, so most of
// them go through its general allocator: about 500 instructions per
// allocation for a Record, measured in the async loop's count
// (benchmarks/bench_async_instructions.py), where raw donation makes none.
//
// Here: freed blocks of one size are kept on a list (up to kMaxFree) and
// handed out again, under a spin lock held for a push or a pop only (blocks
// may be freed on any thread: the reaper's, autograd's; a mutex costs more
// than the allocation it saves).  One pool per block size; beyond kMaxFree
// free blocks, a freed one goes back to the heap.
//
// PoolAllocator<T> lets std::allocate_shared place a Record and its
// control block in one pooled block.
#pragma once

#include <pthread.h>

#include <atomic>
#include <cstddef>
#include <thread>
#include <vector>

namespace torch_xla_donate {

template <size_t Bytes>
class BlockPool {
 public:
  static constexpr size_t kMaxFree = 1 << 16;

  void* Get() {
    void* p = nullptr;
    Lock();
    if (!free_.empty()) {
      p = free_.back();
      free_.pop_back();
    }
    Unlock();
    return p ? p : ::operator new(Bytes);
  }

  void Put(void* p) {
    Lock();
    const bool kept = free_.size() < kMaxFree;
    if (kept) free_.push_back(p);  // capacity reserved: never allocates here
    Unlock();
    if (!kept) ::operator delete(p);
  }

  // One pool per size for the whole process, leaked on purpose: blocks may
  // be freed by objects destroyed after static destructors ran.  A child
  // forked while another thread (the reaper) held the lock starts with it
  // free: the list itself is whole between a push or pop.
  static BlockPool& Global() {
    static BlockPool* pool = [] {
      auto* p = new BlockPool();
      pthread_atfork(nullptr, nullptr, [] { Global().Unlock(); });
      return p;
    }();
    return *pool;
  }

 private:
  BlockPool() { free_.reserve(kMaxFree); }
  void Lock() {
    // The holder pushes or pops one pointer; if it was preempted meanwhile,
    // give it the CPU rather than spin through our time slice.
    while (busy_.exchange(true, std::memory_order_acquire)) std::this_thread::yield();
  }
  void Unlock() { busy_.store(false, std::memory_order_release); }

  std::atomic<bool> busy_{false};
  std::vector<void*> free_;
};

// An allocator over BlockPool<sizeof(T)> for single objects (what
// std::allocate_shared asks for); arrays go to operator new.
template <class T>
struct PoolAllocator {
  using value_type = T;
  PoolAllocator() = default;
  template <class U>
  PoolAllocator(const PoolAllocator<U>&) {}  // NOLINT: rebinding, as allocators do

  T* allocate(size_t n) {
    if (n != 1) return static_cast<T*>(::operator new(n * sizeof(T)));
    return static_cast<T*>(BlockPool<sizeof(T)>::Global().Get());
  }
  void deallocate(T* p, size_t n) {
    if (n != 1) return ::operator delete(p);
    BlockPool<sizeof(T)>::Global().Put(p);
  }
  template <class U>
  bool operator==(const PoolAllocator<U>&) const {
    return true;
  }
  template <class U>
  bool operator!=(const PoolAllocator<U>&) const {
    return false;
  }
};

}  // namespace torch_xla_donate
