// torch_xla's registry of live XLA tensors, walked natively.
//
// The problem: a copy made from a donor in the donating step itself
// (`c = t.to(dev, copy=True)`, `torch.tensor(t)`, `x[...] = t`,
// `empty_like(t).copy_(t)`, `load_state_dict`) has an IR value that *is*
// t's `xla::device_data` node N; the barrier backs such a copy with t's
// buffer, so donating t destroys it.  Nothing in t says so: N's use count
// also counts every node that reads N (a `t * 2` counts as a copy does),
// torch's Node keeps no links to its users, and the buffer's count does not
// change.  The holders of N are found only among torch_xla's live tensors.
//
// torch_xla registers every XLA tensor in XLAGraphExecutor's
// DeviceContextArena, a subclass of torch's torch::lazy::LazyGraphExecutor::
// DeviceContextArena: the registry (per device, tensor id -> weak_ptr<
// LazyTensor::Data>) and its walk (ForAllDeviceContexts, exported by
// libtorch_cpu) are torch's types.  Only the arena's address is private: a
// function-local static of _XLAC.so, which _base/arena.py finds in the
// library's symbol table and hands over with SetLiveTensorArena, which
// checks the object's dynamic type (RTTI) before accepting it.
//
// The walk takes each device's registry lock.  A tensor that dies while
// the lock is held unregisters itself under that lock: every tensor looked
// at is kept alive until the lock is released (torch_xla's own walk does the
// same).  Call the walk without the GIL: a thread holding the registry lock
// (creating a tensor) may be waiting for it.
//
// No torch type leaks out of this header: the heavy includes stay in
// live_tensors.cpp.
#pragma once

#include <Python.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "lazy/lazy_reads.h"

namespace torch_xla_donate {

// One live tensor's LazyTensor::Data, as the walk sees it.  Addresses
// identify objects (compare them), never dereference them outside the walk.
struct LiveTensor {
  int64_t tensor_id = -1;          // LazyTensor::Data::unique_id
  uintptr_t handle = 0;            // its own buffer (BackendData*), 0 without
  uintptr_t ir_node = 0;           // its cached IR value's node, 0 without
  bool ir_is_device_data = false;  // ... which is an `xla::device_data` node
  // Without a handle: the buffer that device_data node holds (a copy made
  // since the last barrier reads its source's); 0 otherwise.
  uintptr_t device_data_buffer = 0;
  // The LazyTensor::Data itself: alive for the duration of the visit only.
  uintptr_t data = 0;
};

// Accepts `arena` as torch_xla's DeviceContextArena when the object there
// has that dynamic type; false, with the reason in `why`, otherwise (the
// walk stays off).  0 turns the walk off.
bool SetLiveTensorArena(uintptr_t arena, std::string* why);

// The accepted arena; 0: the walk is off.
uintptr_t LiveTensorArena();

// The demangled dynamic type of the polymorphic object at `address` ('' for
// 0): the guard's reading, for diagnostics.
std::string ArenaTypeName(uintptr_t address);

// Calls `visit` for every live XLA tensor of every device, under that
// device's registry lock: `visit` must not create or drop XLA tensors nor
// take the GIL.  False (nothing visited) when the walk is off.
bool ForEachLiveTensor(const std::function<void(const LiveTensor&)>& visit);

// A donor as the walk matches it (DonorKeyOf).
struct DonorKey {
  int64_t tensor_id = -1;
  uintptr_t buffer = 0;   // its buffer: its handle, or its device_data node's buffer
  uintptr_t ir_node = 0;  // its cached device_data node, 0 without
  bool own_handle = false;
  // Look also for live tensors holding the buffer itself (without
  // functionalization, whose holder counts cannot be read).
  bool match_handle = false;
};

// The key of the XLA tensor at `impl` (the address `t._cdata` gives);
// false when lazy_reads declines it or it reads no buffer (pending IR).
bool DonorKeyOf(uintptr_t impl, DonorKey* key);

// The same key from what ReadLazyFacts read, without reading it again;
// false when it read no buffer.
bool DonorKeyOfFacts(const LazyFacts& facts, DonorKey* key);

// For each donor, the ids of the live tensors other than the donors whose
// value the barrier will take from the donor's buffer: a tensor without a
// buffer of its own whose IR value is the donor's device_data node or any
// device_data node of its buffer (a copy made since the last barrier), or
// one holding the buffer itself (for a donor that `match_handle`s, or has
// no handle of its own).  False when the walk is off.
bool SameStepCopies(const std::vector<DonorKey>& donors, std::vector<std::vector<int64_t>>* out);

// Registers live_* and same_step_copies on `module` (torch_xla_donate._C).
void RegisterLiveTensors(PyObject* module);

}  // namespace torch_xla_donate
