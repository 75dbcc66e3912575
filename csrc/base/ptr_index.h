// PtrIndex: the ledger's map from a marked tensor (its PyObject address) to
// its slot in the ledger's list of marks.
//
// Why not std::unordered_map: it allocates one node per entry, and the ledger
// inserts one entry per donated tensor per step and clears them all at the
// barrier.  At thousands of tensors per step those small allocations, and
// the heap consolidation they bring on, showed in profiles of the marking
// loop.  This is one flat array with linear probing: no allocation per
// entry, and clearing it keeps its capacity for the next step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace torch_xla_donate {

class PtrIndex {
 public:
  // The slot stored for `key`, or nullptr.
  const size_t* Find(const void* key) const {
    size_t i = Locate(key);
    return i == kNone ? nullptr : &slots_[i].value;
  }

  // Stores `value` for `key` (which must not be null), replacing an old one.
  void Set(const void* key, size_t value) {
    size_t i = Locate(key);
    if (i != kNone) {
      slots_[i].value = value;
      return;
    }
    if ((used_ + 1) * 2 > slots_.size()) Rehash();
    i = Home(key);
    while (slots_[i].key != nullptr && slots_[i].key != Tombstone()) i = Next(i);
    if (slots_[i].key == nullptr) ++used_;
    slots_[i] = Slot{key, value};
    ++size_;
  }

  // Removes `key`; false if it was not there.
  bool Erase(const void* key) {
    size_t i = Locate(key);
    if (i == kNone) return false;
    slots_[i].key = Tombstone();  // keeps the probe chains through it intact
    --size_;
    return true;
  }

  // Empties the index, keeping its capacity.
  void Clear() {
    for (Slot& s : slots_) s.key = nullptr;
    size_ = used_ = 0;
  }

  size_t size() const { return size_; }

 private:
  struct Slot {
    const void* key = nullptr;  // nullptr: never used; Tombstone(): erased
    size_t value = 0;
  };

  static constexpr size_t kNone = ~size_t{0};
  static const void* Tombstone() { return reinterpret_cast<const void*>(uintptr_t{1}); }

  size_t Home(const void* key) const {
    // Objects are 16-byte aligned: drop the low bits, then mix (Fibonacci).
    uint64_t h = (reinterpret_cast<uintptr_t>(key) >> 4) * 0x9E3779B97F4A7C15ull;
    return static_cast<size_t>(h >> 32) & (slots_.size() - 1);
  }
  size_t Next(size_t i) const { return (i + 1) & (slots_.size() - 1); }

  // The index of `key`'s slot, or kNone.
  size_t Locate(const void* key) const {
    if (slots_.empty()) return kNone;
    for (size_t i = Home(key);; i = Next(i)) {
      if (slots_[i].key == key) return i;
      if (slots_[i].key == nullptr) return kNone;
    }
  }

  // Drops the tombstones; doubles the capacity unless few keys are live.
  void Rehash() {
    size_t capacity = slots_.empty() ? 16 : slots_.size();
    if (size_ * 4 >= capacity) capacity *= 2;
    std::vector<Slot> old(capacity);
    old.swap(slots_);
    size_ = used_ = 0;
    for (const Slot& s : old)
      if (s.key != nullptr && s.key != Tombstone()) Set(s.key, s.value);
  }

  std::vector<Slot> slots_;  // a power of two in size, at most half used
  size_t size_ = 0;          // live keys
  size_t used_ = 0;          // live keys and tombstones
};

}  // namespace torch_xla_donate
