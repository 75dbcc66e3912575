// PtrIndex: a map from an object's address to a number, kept flat.  The
// ledger's from a marked tensor (its PyObject address) to its slot in the
// ledger's list of marks; py_types.cpp's from a weakened donor's TensorImpl
// to its entry.
//
// Why not std::unordered_map: it allocates one node per entry, and the ledger
// inserts one entry per donated tensor per step and clears them all at the
// barrier.  At thousands of tensors per step those small allocations, and
// the heap consolidation they bring on, showed in profiles of the marking
// loop.  This is one flat array with linear probing: no allocation per
// entry, and clearing it keeps its capacity for the next step.
//
// The tricky case: keys erased one by one, as many a step as are set (the
// weakened donors of a loop that drops its old state every step).  Erase
// closes the gap it leaves by moving later keys of the same probe chain
// back, so no tombstone piles up, and the array is never rebuilt but to
// grow.
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
    if ((size_ + 1) * 2 > slots_.size()) Grow();
    i = Home(key);
    while (slots_[i].key != nullptr) i = Next(i);
    slots_[i] = Slot{key, value};
    ++size_;
  }

  // Removes `key`; false if it was not there.
  bool Erase(const void* key) {
    size_t hole = Locate(key);
    if (hole == kNone) return false;
    // Every key after the hole up to the next empty slot was placed past
    // its home; one whose home does not lie in (hole, j] may move back
    // into the hole, which then moves to where it was.
    for (size_t j = Next(hole); slots_[j].key != nullptr; j = Next(j)) {
      const size_t home = Home(slots_[j].key);
      const bool stays = hole < j ? (hole < home && home <= j) : (hole < home || home <= j);
      if (!stays) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole].key = nullptr;
    --size_;
    return true;
  }

  // Empties the index, keeping its capacity.
  void Clear() {
    for (Slot& s : slots_) s.key = nullptr;
    size_ = 0;
  }

  size_t size() const { return size_; }

 private:
  struct Slot {
    const void* key = nullptr;  // nullptr: empty
    size_t value = 0;
  };

  static constexpr size_t kNone = ~size_t{0};

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

  // Doubles the capacity (16 at first) and places every key anew.
  void Grow() {
    std::vector<Slot> old(slots_.empty() ? 16 : slots_.size() * 2);
    old.swap(slots_);
    size_ = 0;
    for (const Slot& s : old)
      if (s.key != nullptr) Set(s.key, s.value);
  }

  std::vector<Slot> slots_;  // a power of two in size, at most half used
  size_t size_ = 0;          // keys
};

}  // namespace torch_xla_donate
