// Reading tensors natively: torch's facts (tensor.cpp), torch_xla's (xla_reads.cpp), its live
// tensors (live_tensors.cpp); poisoning (poison.cpp).  No torch type here: pass addresses.
#pragma once

#include <functional>
#include <string>

#include "common.h"

namespace torch_xla_donate {

// -- torch (tensor.cpp) ------------------------------------------------------
struct TensorFacts {
  bool is_xla = false;
  bool is_functional = false;     // a FunctionalTensorWrapper (torch_xla's default)
  long storage_use_count = 0;     // tensors sharing the storage; 0: none (a wrapper)
  long impl_use_count = 0;        // owners of the TensorImpl: Python's, autograd's, ...
  bool has_autograd_meta = true;  // false: certainly no view
  int scalar_type = -1;
  bool symbolic_sizes = false;  // then `sizes` is not filled
  Dims sizes;
  int64_t itemsize = 0;
  int64_t version = -1;  // -1: an inference tensor keeps no version counter
};
// False if torch raised.  Without `with_sizes` the sizes are not asked (XLA recomputes them).
bool ReadTensorFacts(uintptr_t impl, TensorFacts* out, bool with_sizes = true);
bool IsTensor(PyObject* t);
bool IsDonatedType(PyObject* t);
uintptr_t ImplAddress(PyObject* t);  // `t._cdata`, read in place; 0 for no tensor
int Facts(PyObject* t, TensorFacts* facts, bool with_sizes = true);  // 1 read, 0 not
bool HasPythonDispatch(uintptr_t impl);  // a wrapper subclass, a FakeTensor
bool IsView(PyObject* t);
// C++ owners of t's TensorImpl beyond t and a leaf's AccumulateGrad: a graph that saved it.
bool HeldByAutograd(PyObject* t, const TensorFacts& facts);
bool OnlyHeldByItsEntry(PyObject* t);  // no other Python or weak reference, no C++ owner
uintptr_t StorageAddress(uintptr_t impl);
uintptr_t FunctionalInnerImpl(PyObject* t);  // the wrapped TensorImpl, 0 for none
bool PyObjectOwnedByTensor(uintptr_t impl);  // only C++ keeps the Python object alive
PyObject* WrapTensorImpl(uintptr_t impl);    // torch's THPVariable_Wrap, new reference
// Weak references in c10's count on the TensorImpl (no Python object).
uintptr_t WeakTensorTake(PyObject* t);  // 0: not taken
void WeakTensorDrop(uintptr_t impl);
bool WeakTensorAlive(uintptr_t impl);
PyObject* WeakTensorObject(uintptr_t impl);  // new reference, null once it died
// The (file, line) to blame: `where` is (file, line) or a frame depth above _C's caller (0).
bool ResolveWhere(PyObject* where, FilePtr* file, int* line);
DtypeName DtypeNameOf(int scalar_type);  // XLA's short names

// -- torch_xla (xla_reads.cpp) -----------------------------------------------
struct LazyFacts {
  bool is_functional = false;
  int64_t tensor_id = -1;  // `_xla_get_tensor_id`
  bool has_handle = false;
  bool has_value = false;  // the buffer holds a value: not consumed, not computing
  bool has_ir = false;
  bool ir_is_device_data = false;
  bool pending = false;               // `_check_tensor_need_materialization`
  long buffer_use_count = 0;          // the buffer's holders, this read's excluded
  long expected_holders = -1;         // a clean tensor's count; -1 without a handle
  int64_t owner_tensor_id = -1;       // whom torch_xla files the buffer under
  long xla_tensor_refcount = 0;       // 2+: Python tensors sharing an XLATensor
  uintptr_t buffer = 0, ir_node = 0;  // addresses: compare, never dereference

  bool consumed() const { return has_handle && !has_value; }
  bool only_own_holders() const {
    return buffer_use_count <= expected_holders && xla_tensor_refcount <= 1;
  }
};
// False, `out` reset, for no XLATensorImpl (or up-to-date wrapper of one) or a hidden answer.
bool ReadLazyFacts(uintptr_t impl, LazyFacts* out);
bool ReadLazy(PyObject* t, LazyFacts* facts);  // while reads are enabled
bool LazyReadsEnabled();
int BufferDeleted(PyObject* t);         // -1 with a TypeError when it cannot be read
HeldBuffer TakeBuffer(uintptr_t impl);  // a copy of the tensor's BackendDataPtr, or null
bool HeldBufferConsumed(const HeldBuffer& buffer);
void RegisterXlaReads(py::module_& m);

// -- torch_xla's registry of live tensors (live_tensors.cpp) ------------------
struct LiveTensor {
  int64_t tensor_id = -1;
  uintptr_t handle = 0, ir_node = 0;
  bool ir_is_device_data = false;
  uintptr_t device_data_buffer = 0;  // without a handle: the node's buffer
  uintptr_t data = 0;                // its LazyTensor::Data, alive during the visit
};
// Under each device's registry lock, without the GIL; false when the walk is off.
bool ForEachLiveTensor(const std::function<void(const LiveTensor&)>& visit);
struct DonorKey {
  int64_t tensor_id = -1;
  uintptr_t buffer = 0, ir_node = 0;
  bool own_handle = false;
  bool match_handle = false;  // also live tensors holding the buffer itself
};
bool DonorKeyOfFacts(const LazyFacts& facts, DonorKey* key);
// Per donor, the ids of other live tensors the barrier backs with its buffer (copies made since
// the last barrier) but `skip` (clones: a buffer of their own).  False when the walk is off.
bool SameStepCopies(const std::vector<DonorKey>& donors, const std::vector<int64_t>& skip,
                    std::vector<std::vector<int64_t>>* out);
// Per donor, holders of its buffer (or XLATensor) beyond what the donors sharing it account for.
std::vector<long> ExcessHolders(const std::vector<LazyFacts>& facts);
void RegisterLiveTensors(py::module_& m);

// -- Poisoning (poison.cpp) ---------------------------------------------------
int Poison(PyObject* t, const RecordPtr& record, const std::string& note = "");  // -1: error
PyObject* TwinClassOf(PyTypeObject* type);  // borrowed, null when none registered
void RegisterPoison(py::module_& m);

}  // namespace torch_xla_donate
