// What torch_xla knows about an XLA tensor, read in place through torch's
// lazy-tensor headers instead of one `torch_xla._XLAC` call per question.
//
// The problem: every `_XLAC` question (an id, pending IR, a consumed
// buffer, the owner of a buffer) costs 1.8k+ instructions, nearly all of
// them pybind11's dispatch, and who else holds a buffer cannot be asked at
// all: Python sees only Python holders.  torch_xla's wheel ships no C++
// headers, but its XLATensor derives from torch's torch::lazy::LazyTensor,
// whose headers ship with torch, and its data (LazyTensor::Data: handle,
// IR value, id) and device buffers (torch::lazy::BackendData) are torch
// types.  The one torch_xla fact relied on: XLATensorImpl (a
// c10::TensorImpl) holds its XLATensorPtr (an intrusive_ptr to an
// XLATensor, itself a LazyTensor at offset 0) as its first member right
// after the c10::TensorImpl base (torch_xla/csrc/tensor_impl.h, 2.7-2.9).
//
// The guard: nothing is read from a TensorImpl that is not exactly an
// XLATensorImpl.  Its vtable pointer is learned once from a known XLA
// tensor, whose dynamic type's RTTI name must be torch_xla::XLATensorImpl
// (LearnXlaTensorType); each read compares the vtable pointer and declines
// anything else (a CPU tensor, a wrapper subclass, an unknown type), and
// anything torch_xla answers in a way these headers cannot see (a
// functional wrapper awaiting a sync, a tensor that is only an XLA view or
// host data).  A declined read returns false: the caller asks `_XLAC`.
// Whether reads are on at all (the self-test in _base/reads.py agreed with
// `_XLAC`, TORCH_XLA_DONATE_NATIVE_READS is not 0) is the caller's state,
// set with SetLazyReadsEnabled.
//
// No torch type leaks out of this header: the heavy includes stay in
// lazy_reads.cpp.
#pragma once

#include <Python.h>

#include <cstddef>
#include <cstdint>
#include <string>

namespace torch_xla_donate {

struct LazyFacts {
  bool is_functional = false;  // read through a FunctionalTensorWrapper
  int64_t tensor_id = -1;      // LazyTensor::GetUniqueId(), `_xla_get_tensor_id`
  bool has_handle = false;     // the tensor's data holds a BackendData
  // The buffer (of the handle, else of a device_data IR value) holds a
  // value: false for a consumed buffer and for an output still computing.
  bool has_value = false;
  bool has_ir = false;             // an IR value is cached
  bool ir_is_device_data = false;  // ... and its node is `xla::device_data`
  // Needs a computation (`_check_tensor_need_materialization`): no handle,
  // and an IR value that is not device data.
  bool pending = false;
  // shared_ptr holders of the buffer (this read's own copy excluded); 0:
  // no buffer known.
  long buffer_use_count = 0;
  // What a clean tensor's buffer count is: 1 (its handle) + 1 if its cached
  // IR value is a device_data node + 1 if it has no value yet (the output
  // of a step still dispatching).  -1 without a handle.
  long expected_holders = -1;
  // The tensor id the buffer is filed under now (LazyGraphExecutor::
  // DeviceDataInfo::tensor_id); -1 when the buffer carries no such info.
  // torch_xla's owner query may answer otherwise: it files a handle without
  // a cached IR value under the tensor itself (lazy_owner_ids says what it
  // would answer, without doing it).
  int64_t owner_tensor_id = -1;
  // Owners of the XLATensor: 1, or more when torch_xla made two Python
  // tensors share one (`_replace_xla_tensor`).
  long xla_tensor_refcount = 0;
  uintptr_t buffer = 0;   // address of the BackendData: one buffer, one address
  uintptr_t ir_node = 0;  // address of the cached IR value's node, 0 without

  bool consumed() const { return has_handle && !has_value; }  // `_is_placecholder`
  // No holder of the buffer, nor owner of the XLA tensor, beyond a clean
  // tensor's own (the rule lazy_bindings.cpp's lazy_excess judges by).
  bool only_own_holders() const {
    return buffer_use_count <= expected_holders && xla_tensor_refcount <= 1;
  }
};

// Learns XLATensorImpl's vtable from the tensor whose c10::TensorImpl is at
// `impl` (unwrapping a functional wrapper), after checking its RTTI name.
// False, with the reason in `why`, when it is no XLATensorImpl.
bool LearnXlaTensorType(uintptr_t impl, std::string* why);

// Reads the facts of the tensor at `impl` (the address `t._cdata` gives).
// False, `out` reset, when the type was not learned, the tensor is no
// XLATensorImpl (or a functional wrapper of one), or torch_xla keeps its
// answer where these headers cannot see (see above).  Never throws.
// Independent of SetLazyReadsEnabled: the self-test reads before enabling.
bool ReadLazyFacts(uintptr_t impl, LazyFacts* out);

// BackendData::GetHandle() (`_get_tensors_handle`) of the buffer at `buffer`
// (LazyFacts::buffer, read while its tensor lives); 0 for 0, for a buffer
// without a value, and if torch_xla refuses.  Not part of ReadLazyFacts: no
// decision needs it, and torch_xla's GetHandle tests the value again (a lock
// of the device buffer), a second time per read on every donor.
int64_t BufferHandle(uintptr_t buffer);

// Before a pass over many tensors no code has touched for a while (the
// commit's first read of its donors, the poisoning after the barrier):
// starts loading, level by level for all of them at once, what
// ReadLazyFacts and TakeBuffer read behind each TensorImpl address in
// `impls` (0: skipped): the wrapper, the XLATensorImpl, the XLATensor, its
// Data, IR node and buffer.  A pass that reads tensor by tensor waits for
// each level's miss in turn; here the misses of all tensors overlap.
// Reads only what it prefetched one level before, checks types as
// ReadLazyFacts does, changes nothing; a no-op until the type is learned.
// Works in groups of kPrefetchGroup, allocating nothing: a level of a group
// takes about as long as a miss, so its first loads have arrived by the
// time the next level reads them.
constexpr size_t kPrefetchGroup = 128;
void PrefetchLazy(const uintptr_t* impls, size_t n);

// A donor's buffer, held without its tensor (hooks/commit.cpp releases a
// donor nobody else refers to at the commit and keeps only this for its
// verdict): a heap copy of the tensor's torch::lazy::BackendDataPtr, the
// same shared_ptr the XLATensor held, so it counts as one holder as the
// tensor did.  TakeBuffer returns nullptr when the read declines or the
// tensor holds no handle (the caller keeps the tensor then); never throws.
struct HeldBuffer;
HeldBuffer* TakeBuffer(uintptr_t impl);
// `_is_placecholder` of the held buffer: it holds no value (consumed).
bool HeldBufferConsumed(const HeldBuffer* buffer);
void DropBuffer(HeldBuffer* buffer);
// Asks the CPU to start loading the held BackendData (py_types.h
// PrefetchEntries); reads nothing but the HeldBuffer itself.
void PrefetchHeldBuffer(const HeldBuffer* buffer);

// lazy_tensor_of.h PointCarrier at a held buffer, and the carrier's own
// handle given back (false if it pointed nowhere).
bool PointCarrierAt(PyObject* carrier, const HeldBuffer* buffer);
bool RestoreCarrier(PyObject* carrier);

// The process-wide switch the callers test (LazyReadsEnabled) before
// reading; off until the self-test passes.
void SetLazyReadsEnabled(bool on);
bool LazyReadsEnabled();

}  // namespace torch_xla_donate
