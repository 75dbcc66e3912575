// The commit of a step's marks, natively: begin (the marks into a new
// step), the split (the commit's rules, in one function: Judge), and after
// the execution the poisoning and the verdicts' reads.  Python arms and
// disarms torch_xla's donor flags (_hooks/commit.py) and words every
// refusal: no call into Python per donor.
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

#include "lazy/lazy_reads.h"

namespace torch_xla_donate {

// How a commit decides a mark (values are Python's too, C.Split).
enum class Split : int {
  kDonor = 0,
  kHeld,    // views, aliases or an autograd graph hold the tensor: Python judges them
  kCopy,    // a live tensor the barrier backs with its buffer (a copy made in the step)
  kExcess,  // more holders of the buffer than the donors sharing it account for
  kUnread,  // its buffer cannot be read (no plain device data any more)
};

// For each of `facts` (the donors' reads, functional ones), the holders of
// its buffer or XLA tensor beyond those the donors sharing that buffer
// account for (0: none).  Donors of one buffer are judged together.
std::vector<long> ExcessHolders(const std::vector<LazyFacts>& facts);

// Registers commit, screen, finish, settle_entries, release_unheld,
// live_held and entry_consumed on `module`.
void RegisterCommit(PyObject* module);

}  // namespace torch_xla_donate
