// See lazy_reads.h.  The only file that includes torch's lazy-tensor and
// functionalization headers (they pull in much of ATen: keep them here).
// What it calls out of line lives in libtorch_cpu (LazyTensor::data(),
// FunctionalTensorWrapper::is_up_to_date(), torch::lazy::getBackend(),
// c10::Symbol::fromQualString()); BackendData's HasValue() and GetHandle()
// are virtual calls into torch_xla.
#include "lazy/lazy_reads.h"

#include <ATen/FunctionalTensorWrapper.h>
#include <c10/core/TensorImpl.h>
#include <c10/util/intrusive_ptr.h>
#include <cxxabi.h>
#include <torch/csrc/lazy/backend/backend_data.h>
#include <torch/csrc/lazy/backend/backend_interface.h>
#include <torch/csrc/lazy/core/ir.h>
#include <torch/csrc/lazy/core/lazy_graph_executor.h>
#include <torch/csrc/lazy/core/tensor.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <exception>
#include <typeinfo>
#include <unordered_map>

#include "base/block_pool.h"
#include "base/prefetch.h"
#include "base/tensor_access.h"
#include "lazy/lazy_tensor_of.h"
#include "lazy/reaper.h"

namespace torch_xla_donate {
namespace {

using torch::lazy::BackendData;
using torch::lazy::LazyGraphExecutor;
using torch::lazy::LazyTensor;

// Where a c10::TensorImpl subclass puts its first member of pointer size:
// what XLATensorImpl's `XLATensorPtr tensor_` is (the compiler's layout of
// the base, tail padding included, not a hand-written number).
struct FirstMemberProbe : c10::TensorImpl {
  c10::intrusive_ptr<LazyTensor> first;
};
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
constexpr size_t kXlaTensorOffset = offsetof(FirstMemberProbe, first);
#pragma GCC diagnostic pop

constexpr char kXlaTensorImplName[] = "torch_xla::XLATensorImpl";
constexpr char kXlaTensorName[] = "torch_xla::XLATensor";

std::atomic<const void*> g_xla_impl_vtable{nullptr};
// DeviceDataInfo's vtable as last seen, to skip the dynamic_cast.
std::atomic<const void*> g_device_data_info_vtable{nullptr};
std::atomic<bool> g_enabled{false};

const void* VtableOf(const void* object) { return *static_cast<const void* const*>(object); }

// The TensorImpl torch_xla sees behind `impl`: the wrapped value of a
// functional wrapper (at::functionalization::impl::isFunctionalTensor and
// unsafeGetFunctionalWrapper, which test and cast the same way).  nullptr
// for a wrapper with updates it has not applied yet: torch_xla syncs it
// first (a change this read must not make).
c10::TensorImpl* Unwrapped(c10::TensorImpl* impl, bool* functional) {
  *functional = impl->key_set().has(c10::DispatchKey::Functionalize);
  if (!*functional) return impl;
  auto* wrapper = static_cast<at::FunctionalTensorWrapper*>(impl);
  if (!wrapper->is_up_to_date()) return nullptr;
  return wrapper->value().unsafeGetTensorImpl();
}

int64_t OwnerId(const BackendData& buffer) {
  BackendData::Info* info = buffer.info();
  if (info == nullptr) return -1;
  if (VtableOf(info) != g_device_data_info_vtable.load(std::memory_order_relaxed)) {
    auto* data_info = dynamic_cast<LazyGraphExecutor::DeviceDataInfo*>(info);
    if (data_info == nullptr) return -1;
    g_device_data_info_vtable.store(VtableOf(info), std::memory_order_relaxed);
  }
  return static_cast<LazyGraphExecutor::DeviceDataInfo*>(info)->tensor_id;
}

void ReadBuffer(BackendData& buffer, LazyFacts* out) {
  out->buffer = reinterpret_cast<uintptr_t>(&buffer);
  out->has_value = buffer.HasValue();
  out->owner_tensor_id = OwnerId(buffer);
}

bool Read(c10::TensorImpl* outer, LazyFacts* out) {
  LazyTensor* lazy = XlaLazyTensorOf(reinterpret_cast<uintptr_t>(outer), &out->is_functional);
  if (lazy == nullptr) return false;
  out->xla_tensor_refcount = static_cast<long>(c10::raw::intrusive_ptr::use_count(lazy));
  const std::shared_ptr<LazyTensor::Data>& data = lazy->data();
  out->tensor_id = data->unique_id;
  const torch::lazy::Value& ir = data->ir_value;
  out->has_ir = ir.node != nullptr;
  out->ir_node = reinterpret_cast<uintptr_t>(ir.node.get());
  out->ir_is_device_data = out->has_ir && ir.node->op().op == DeviceDataOp();
  if (const torch::lazy::BackendDataPtr& handle = data->handle) {
    out->has_handle = true;
    out->buffer_use_count = static_cast<long>(handle.use_count());
    ReadBuffer(*handle, out);
    out->expected_holders = 1 + (out->ir_is_device_data ? 1 : 0) + (out->has_value ? 0 : 1);
    return true;
  }
  // No handle and no IR: host data, or (functionalization off) one of
  // torch_xla's own views, whose value these headers cannot see.
  if (!out->has_ir) return false;
  out->pending = !out->ir_is_device_data;
  if (out->ir_is_device_data) {
    // The buffer a device_data node holds (a copy made since the last step
    // reads its source's node).
    torch::lazy::BackendDataPtr buffer =
        torch::lazy::getBackend()->GetComputationDataFromNode(ir.node.get());
    if (buffer) {
      out->buffer_use_count = static_cast<long>(buffer.use_count()) - 1;
      ReadBuffer(*buffer, out);
    }
  }
  return true;
}

}  // namespace

int64_t BufferHandle(uintptr_t address) {
  if (address == 0) return 0;
  auto* buffer = reinterpret_cast<BackendData*>(address);
  try {
    // torch_xla's GetHandle() refuses a deleted buffer.
    return buffer->HasValue() ? buffer->GetHandle() : 0;
  } catch (...) {
    return 0;
  }
}

const c10::Symbol& DeviceDataOp() {
  static const c10::Symbol op = c10::Symbol::fromQualString("xla::device_data");
  return op;
}

std::string Demangled(const char* name) {
  int status = 0;
  char* text = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  std::string out = status == 0 && text ? text : name;
  std::free(text);
  return out;
}

LazyTensor* XlaLazyTensorOf(uintptr_t address, bool* functional) {
  const void* xla_vtable = g_xla_impl_vtable.load(std::memory_order_acquire);
  if (xla_vtable == nullptr) return nullptr;
  c10::TensorImpl* impl = Unwrapped(reinterpret_cast<c10::TensorImpl*>(address), functional);
  if (impl == nullptr || VtableOf(impl) != xla_vtable) return nullptr;
  return *reinterpret_cast<LazyTensor* const*>(reinterpret_cast<const char*>(impl) +
                                               kXlaTensorOffset);
}

bool LearnXlaTensorType(uintptr_t address, std::string* why) {
  try {
    bool functional = false;
    c10::TensorImpl* impl = Unwrapped(reinterpret_cast<c10::TensorImpl*>(address), &functional);
    if (impl == nullptr) {
      *why = "the sample tensor's functional wrapper is not up to date";
      return false;
    }
    const std::string name = Demangled(typeid(*impl).name());
    if (name != kXlaTensorImplName) {
      *why = "the sample tensor is a " + name + ", not a " + kXlaTensorImplName;
      return false;
    }
    // The layout fact: its first member is the XLATensorPtr, whose object
    // must have that dynamic type.
    auto* lazy = *reinterpret_cast<LazyTensor* const*>(reinterpret_cast<const char*>(impl) +
                                                       kXlaTensorOffset);
    const std::string member = lazy ? Demangled(typeid(*lazy).name()) : std::string("null");
    if (member != kXlaTensorName) {
      *why = std::string(kXlaTensorImplName) + "'s first member is a " + member + ", not a " +
             kXlaTensorName;
      return false;
    }
    g_xla_impl_vtable.store(VtableOf(impl), std::memory_order_release);
    return true;
  } catch (const std::exception& e) {
    *why = std::string("learning the XLA tensor type raised: ") + e.what();
    return false;
  }
}

bool ReadLazyFacts(uintptr_t address, LazyFacts* out) {
  *out = LazyFacts();
  try {
    if (Read(reinterpret_cast<c10::TensorImpl*>(address), out)) return true;
  } catch (...) {
  }
  *out = LazyFacts();
  return false;
}

struct HeldBuffer {
  torch::lazy::BackendDataPtr data;
  // One per donor and step, made and freed in bursts: recycled
  // (block_pool.h).
  using Pool = BlockPool<sizeof(torch::lazy::BackendDataPtr)>;
  static void* operator new(size_t) { return Pool::Global().Get(); }
  static void operator delete(void* p) { Pool::Global().Put(p); }
};
static_assert(sizeof(HeldBuffer) == sizeof(torch::lazy::BackendDataPtr), "one pooled size");

HeldBuffer* TakeBuffer(uintptr_t address) {
  try {
    const void* xla_vtable = g_xla_impl_vtable.load(std::memory_order_acquire);
    if (xla_vtable == nullptr) return nullptr;
    bool functional = false;
    c10::TensorImpl* impl = Unwrapped(reinterpret_cast<c10::TensorImpl*>(address), &functional);
    if (impl == nullptr || VtableOf(impl) != xla_vtable) return nullptr;
    auto* lazy = *reinterpret_cast<LazyTensor* const*>(reinterpret_cast<const char*>(impl) +
                                                       kXlaTensorOffset);
    if (lazy == nullptr) return nullptr;
    const torch::lazy::BackendDataPtr& handle = lazy->data()->handle;
    if (!handle) return nullptr;
    return new HeldBuffer{handle};
  } catch (...) {
    return nullptr;
  }
}

bool HeldBufferConsumed(const HeldBuffer* buffer) { return !buffer->data->HasValue(); }

void DropBuffer(HeldBuffer* buffer) {
  // A consumed buffer holds no device memory: its object (torch_xla's, about
  // 1.3k instructions to destroy) is freed off the loop's thread, as raw
  // donation's is (reaper.h).  One with a value is freed now.
  if (buffer->data && !buffer->data->HasValue()) {
    ReapLater(buffer, [](void* p) { delete static_cast<HeldBuffer*>(p); });
    return;
  }
  delete buffer;
}

namespace {
// A TensorImpl and the first member after it: the functional wrapper's
// value and the XLATensorImpl's XLATensorPtr both sit there, and the next
// level reads them.
constexpr size_t kImplBytes = kXlaTensorOffset + sizeof(void*);

// PrefetchLazy's levels for one group of `n` <= kPrefetchGroup tensors,
// each level from the one prefetched before.
void PrefetchLevels(const uintptr_t* impls, size_t n, const void* xla_vtable) {
  const void* level[kPrefetchGroup];
  for (size_t i = 0; i < n; ++i)
    if (impls[i]) PrefetchBytes(reinterpret_cast<const void*>(impls[i]), kImplBytes);
  for (size_t i = 0; i < n; ++i) {  // the wrapper's value, or the impl itself
    auto* impl = reinterpret_cast<c10::TensorImpl*>(impls[i]);
    if (impl && impl->key_set().has(c10::DispatchKey::Functionalize)) {
      impl = static_cast<at::FunctionalTensorWrapper*>(impl)->value().unsafeGetTensorImpl();
      PrefetchBytes(impl, kImplBytes);
    }
    level[i] = impl;
  }
  for (size_t i = 0; i < n; ++i) {  // the XLATensor
    const void* impl = level[i];
    level[i] = impl == nullptr || VtableOf(impl) != xla_vtable
                   ? nullptr
                   : *reinterpret_cast<LazyTensor* const*>(static_cast<const char*>(impl) +
                                                           kXlaTensorOffset);
    if (level[i]) PrefetchBytes(level[i], sizeof(LazyTensor));
  }
  for (size_t i = 0; i < n; ++i) {  // its Data
    if (level[i]) level[i] = static_cast<const LazyTensor*>(level[i])->data().get();
    if (level[i]) PrefetchBytes(level[i], sizeof(LazyTensor::Data));
  }
  for (size_t i = 0; i < n; ++i) {  // the IR node and the buffer
    const auto* data = static_cast<const LazyTensor::Data*>(level[i]);
    if (data && data->ir_value.node) __builtin_prefetch(data->ir_value.node.get());
    if (data && data->handle) __builtin_prefetch(data->handle.get());
  }
}
}  // namespace

void PrefetchLazy(const uintptr_t* impls, size_t n) {
  const void* xla_vtable = g_xla_impl_vtable.load(std::memory_order_acquire);
  if (xla_vtable == nullptr) return;
  try {
    for (size_t first = 0; first < n; first += kPrefetchGroup)
      PrefetchLevels(impls + first, std::min(kPrefetchGroup, n - first), xla_vtable);
  } catch (...) {
    // LazyTensor::data() refuses a null Data: a hint less, nothing else.
  }
}

void PrefetchHeldBuffer(const HeldBuffer* buffer) { __builtin_prefetch(buffer->data.get()); }

namespace {
// Each pointed carrier's own handle, while it points at another buffer.
std::unordered_map<LazyTensor*, torch::lazy::BackendDataPtr> g_carried;
}  // namespace

bool PointCarrier(PyObject* carrier, const torch::lazy::BackendDataPtr& buffer) {
  const uintptr_t address = ImplAddress(carrier);
  bool functional = false;
  LazyTensor* lazy = address == 0 ? nullptr : XlaLazyTensorOf(address, &functional);
  if (lazy == nullptr || !buffer || g_carried.count(lazy)) return false;
  const std::shared_ptr<LazyTensor::Data>& data = lazy->data();
  g_carried.emplace(lazy, std::move(data->handle));
  data->handle = buffer;
  return true;
}

bool PointCarrierAt(PyObject* carrier, const HeldBuffer* buffer) {
  return buffer != nullptr && PointCarrier(carrier, buffer->data);
}

bool RestoreCarrier(PyObject* carrier) {
  const uintptr_t address = ImplAddress(carrier);
  bool functional = false;
  LazyTensor* lazy = address == 0 ? nullptr : XlaLazyTensorOf(address, &functional);
  auto it = lazy == nullptr ? g_carried.end() : g_carried.find(lazy);
  if (it == g_carried.end()) return false;
  lazy->data()->handle = std::move(it->second);
  g_carried.erase(it);
  return true;
}

void SetLazyReadsEnabled(bool on) { g_enabled.store(on, std::memory_order_release); }

bool LazyReadsEnabled() { return g_enabled.load(std::memory_order_acquire); }

}  // namespace torch_xla_donate
