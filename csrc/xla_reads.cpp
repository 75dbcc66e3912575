// What torch_xla knows about an XLA tensor, read through torch's lazy-tensor
// types behind the one torch_xla layout fact: XLATensorImpl keeps its
// XLATensorPtr as its first member after c10::TensorImpl (docs/design.md,
// "Reading torch_xla").  Every read checks the TensorImpl's vtable against
// the one learned, under an RTTI check, from a known XLA tensor.
#include <ATen/FunctionalTensorWrapper.h>
#include <c10/core/TensorImpl.h>
#include <cxxabi.h>
#include <torch/csrc/lazy/backend/backend_interface.h>
#include <torch/csrc/lazy/core/ir.h>
#include <torch/csrc/lazy/core/lazy_graph_executor.h>

#include <atomic>
#include <cstdlib>
#include <typeinfo>
#include <unordered_map>

#include "lazy.h"

namespace torch_xla_donate {
namespace {

using torch::lazy::BackendData;
using torch::lazy::LazyTensor;

// Where a c10::TensorImpl subclass puts its first pointer-sized member (the
// compiler's layout of the base, not a hand-written number).
struct FirstMemberProbe : c10::TensorImpl {
  c10::intrusive_ptr<LazyTensor> first;
};
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winvalid-offsetof"
constexpr size_t kXlaTensorOffset = offsetof(FirstMemberProbe, first);
#pragma GCC diagnostic pop

std::atomic<const void*> g_xla_impl_vtable{nullptr};
std::atomic<const void*> g_device_data_info_vtable{nullptr};  // skips a dynamic_cast
std::atomic<bool> g_enabled{false};

const void* VtableOf(const void* object) { return *static_cast<const void* const*>(object); }

LazyTensor* FirstMember(c10::TensorImpl* impl) {
  return *reinterpret_cast<LazyTensor* const*>(reinterpret_cast<const char*>(impl) +
                                               kXlaTensorOffset);
}

// What torch_xla sees behind `impl`: a functional wrapper's value; null for
// a wrapper with updates not applied yet (torch_xla would sync it first).
c10::TensorImpl* Unwrapped(c10::TensorImpl* impl, bool* functional) {
  *functional = impl->key_set().has(c10::DispatchKey::Functionalize);
  if (!*functional) return impl;
  auto* wrapper = static_cast<at::FunctionalTensorWrapper*>(impl);
  return wrapper->is_up_to_date() ? wrapper->value().unsafeGetTensorImpl() : nullptr;
}

int64_t OwnerId(const BackendData& buffer) {
  BackendData::Info* info = buffer.info();
  if (info == nullptr) return -1;
  using DeviceDataInfo = torch::lazy::LazyGraphExecutor::DeviceDataInfo;
  if (VtableOf(info) != g_device_data_info_vtable.load(std::memory_order_relaxed)) {
    if (dynamic_cast<DeviceDataInfo*>(info) == nullptr) return -1;
    g_device_data_info_vtable.store(VtableOf(info), std::memory_order_relaxed);
  }
  return static_cast<DeviceDataInfo*>(info)->tensor_id;
}

void ReadBuffer(BackendData& buffer, LazyFacts* out) {
  out->buffer = reinterpret_cast<uintptr_t>(&buffer);
  out->has_value = buffer.HasValue();
  out->owner_tensor_id = OwnerId(buffer);
}

bool Read(uintptr_t impl, LazyFacts* out) {
  LazyTensor* lazy = XlaLazyTensorOf(impl, &out->is_functional);
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
  // Neither handle nor IR: host data, or one of torch_xla's own views.
  if (!out->has_ir) return false;
  out->pending = !out->ir_is_device_data;
  if (out->ir_is_device_data) {  // a copy made since the last barrier reads its source's node
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
  return impl == nullptr || VtableOf(impl) != xla_vtable ? nullptr : FirstMember(impl);
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
    if (name != "torch_xla::XLATensorImpl") {
      *why = "the sample tensor is a " + name + ", not a torch_xla::XLATensorImpl";
      return false;
    }
    LazyTensor* lazy = FirstMember(impl);
    const std::string member = lazy ? Demangled(typeid(*lazy).name()) : "null";
    if (member != "torch_xla::XLATensor") {
      *why = "torch_xla::XLATensorImpl's first member is a " + member +
             ", not a torch_xla::XLATensor";
      return false;
    }
    g_xla_impl_vtable.store(VtableOf(impl), std::memory_order_release);
    return true;
  } catch (const std::exception& e) {
    *why = std::string("learning the XLA tensor type raised: ") + e.what();
    return false;
  }
}

bool ReadLazyFacts(uintptr_t impl, LazyFacts* out) {
  *out = LazyFacts();
  try {
    if (Read(impl, out)) return true;
  } catch (...) {
  }
  *out = LazyFacts();
  return false;
}

void SetLazyReadsEnabled(bool on) { g_enabled.store(on, std::memory_order_release); }
bool LazyReadsEnabled() { return g_enabled.load(std::memory_order_acquire); }

bool ReadLazy(PyObject* t, LazyFacts* facts) {
  if (!LazyReadsEnabled()) return false;
  const uintptr_t impl = ImplAddress(t);
  return impl != 0 && ReadLazyFacts(impl, facts);
}

bool HasPendingIr(PyObject* t) {
  LazyFacts facts;
  return !ReadLazy(t, &facts) || facts.pending;  // declined: no plain device data
}

int BufferDeleted(PyObject* t) {
  LazyFacts facts;
  if (ReadLazy(t, &facts)) return facts.consumed() ? 1 : 0;
  PyErr_SetString(PyExc_TypeError, "torch_xla_donate cannot read this tensor's device buffer");
  return -1;
}

int64_t BufferHandle(uintptr_t address) {
  if (address == 0) return 0;
  auto* buffer = reinterpret_cast<BackendData*>(address);
  try {
    return buffer->HasValue() ? buffer->GetHandle() : 0;  // GetHandle refuses a deleted one
  } catch (...) {
    return 0;
  }
}

struct HeldBuffer {
  torch::lazy::BackendDataPtr data;
};

HeldBuffer* TakeBuffer(uintptr_t address) {
  try {
    bool functional = false;
    LazyTensor* lazy = XlaLazyTensorOf(address, &functional);
    if (lazy == nullptr || !lazy->data()->handle) return nullptr;
    return new HeldBuffer{lazy->data()->handle};
  } catch (...) {
    return nullptr;
  }
}

bool HeldBufferConsumed(const HeldBuffer* buffer) { return !buffer->data->HasValue(); }

void DropBuffer(HeldBuffer* buffer) { delete buffer; }

// Each pointed carrier's own handle, while it points at another buffer.
std::unordered_map<LazyTensor*, torch::lazy::BackendDataPtr> g_carried;

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

// -- Bindings: every per-tensor read answers None when it declines ----------
namespace {

bool ReadMaybeForced(py::handle t, bool force, LazyFacts* facts) {
  if (!force) return ReadLazy(t.ptr(), facts);
  const uintptr_t impl = ImplAddress(t.ptr());
  return impl != 0 && ReadLazyFacts(impl, facts);
}

// A one-tensor read with the CPython API: pybind11's dispatch alone would
// cost what the read saves.
template <PyObject* (*Answer)(const LazyFacts&)>
PyObject* ReadOne(PyObject*, PyObject* t) {
  LazyFacts f;
  if (!ReadLazy(t, &f)) Py_RETURN_NONE;
  return Answer(f);
}
PyObject* TensorId(const LazyFacts& f) { return PyLong_FromLongLong(f.tensor_id); }
PyObject* IsPending(const LazyFacts& f) { return PyBool_FromLong(f.pending); }
PyObject* IsConsumed(const LazyFacts& f) { return PyBool_FromLong(f.consumed()); }
PyObject* BufferKey(const LazyFacts& f) { return PyLong_FromSize_t(f.has_value ? f.buffer : 0); }

PyMethodDef kMethods[] = {
    {"lazy_tensor_id", ReadOne<TensorId>, METH_O, "_xla_get_tensor_id, or None: declined."},
    {"lazy_is_pending", ReadOne<IsPending>, METH_O,
     "_check_tensor_need_materialization, or None: declined."},
    {"lazy_is_consumed", ReadOne<IsConsumed>, METH_O, "_is_placecholder, or None: declined."},
    {"lazy_buffer_key", ReadOne<BufferKey>, METH_O,
     "The live buffer's address (equal: one buffer; 0: none live), or None: declined."},
    {nullptr, nullptr, 0, nullptr},
};

// What torch_xla's owner query answers, without its side effects: a handle
// without a cached IR value gets a new node filed under the tensor itself.
bool QueryOwner(const LazyFacts& f, int64_t* owner) {
  if (!f.has_value || !(f.has_handle && !f.has_ir) && !f.ir_is_device_data) return false;
  *owner = f.has_handle && !f.has_ir ? f.tensor_id : f.owner_tensor_id;
  return true;
}

}  // namespace

void RegisterXlaReads(py::module_& m) {
  Check(PyModule_AddFunctions(m.ptr(), kMethods) == 0);
  m.attr("LAZY_FACT_FIELDS") = py::make_tuple(
      "is_functional", "tensor_id", "has_handle", "has_value", "has_ir", "ir_is_device_data",
      "pending", "buffer_use_count", "expected_holders", "owner_tensor_id", "xla_tensor_refcount",
      "buffer", "handle");
  m.def(
      "lazy_facts",
      [](py::handle t, bool force) -> py::object {
        LazyFacts f;
        if (!ReadMaybeForced(t, force, &f)) return py::none();
        return py::make_tuple(f.is_functional, f.tensor_id, f.has_handle, f.has_value, f.has_ir,
                              f.ir_is_device_data, f.pending, f.buffer_use_count,
                              f.expected_holders, f.owner_tensor_id, f.xla_tensor_refcount,
                              f.buffer, BufferHandle(f.buffer));
      },
      py::arg("tensor"), py::arg("force") = false,
      "Every fact as a tuple (LAZY_FACT_FIELDS), or None; `force`: also while reads are off.");
  m.def(
      "lazy_holders",
      [](py::iterable tensors, bool force) {
        py::list out;
        for (py::handle t : tensors) {
          LazyFacts f;
          if (ReadMaybeForced(t, force, &f) && f.has_handle && f.is_functional)
            out.append(py::make_tuple(f.expected_holders, f.buffer_use_count,
                                      f.xla_tensor_refcount));
          else
            out.append(py::none());  // no handle, or no functionalization: holders unseen
        }
        return out;
      },
      py::arg("tensors"), py::arg("force") = false,
      "Per tensor (expected, actual buffer holders, XLATensor owners), or None.");
  m.def(
      "lazy_excess",
      [](py::sequence tensors, bool force) -> py::object {
        std::vector<LazyFacts> facts(py::len(tensors));
        for (size_t i = 0; i < facts.size(); ++i)
          if (!ReadMaybeForced(tensors[i], force, &facts[i]) || !facts[i].has_handle ||
              !facts[i].is_functional)
            return py::none();
        const std::vector<long> extra = ExcessHolders(facts);
        py::list over;
        for (size_t i = 0; i < extra.size(); ++i)
          if (extra[i] > 0) over.append(py::make_tuple(i, extra[i]));
        return std::move(over);
      },
      py::arg("tensors"), py::arg("force") = false,
      "[(index, extra holders)] of the donors with holders beyond their own; None: unknown.");
  m.def(
      "lazy_owner_ids",
      [](py::iterable tensors, bool force) {
        py::list out;
        for (py::handle t : tensors) {
          LazyFacts f;
          int64_t owner = -1;
          if (ReadMaybeForced(t, force, &f) && QueryOwner(f, &owner))
            out.append(owner);
          else
            out.append(py::none());
        }
        return out;
      },
      py::arg("tensors"), py::arg("force") = false,
      "Per tensor, the id torch_xla's owner query files its live buffer under, or None.");
  m.def(
      "lazy_learn",
      [](py::handle t) -> std::string {
        const uintptr_t impl = ImplAddress(t.ptr());
        std::string why = "the sample is no torch.Tensor";
        return impl != 0 && LearnXlaTensorType(impl, &why) ? std::string() : why;
      },
      py::arg("tensor"), "Learns XLATensorImpl's type from an XLA tensor: '' or why not.");
  m.def("lazy_set_enabled", &SetLazyReadsEnabled, py::arg("on"));
  m.def(
      "pending_flags",
      [](py::list tensors) {
        py::list out;
        for (py::handle t : tensors) {
          TensorFacts facts;
          if (Facts(t.ptr(), &facts, false) != 1 || !facts.is_xla)
            throw py::type_error(std::string("pending_flags() takes XLA tensors, got a ") +
                                 Py_TYPE(t.ptr())->tp_name);
          out.append(py::bool_(HasPendingIr(t.ptr())));
        }
        return out;
      },
      py::arg("tensors"), "Pending computation per XLA tensor (declined: pending).");
  m.def(
      "point_carrier",
      [](py::handle carrier, py::handle entry) {
        return PointCarrierAt(carrier.ptr(), EntryBuffer(entry.ptr()));
      },
      py::arg("carrier"), py::arg("entry"),
      "Points `carrier` at the buffer a released entry keeps; False when it keeps none.");
  m.def(
      "restore_carrier", [](py::handle carrier) { return RestoreCarrier(carrier.ptr()); },
      py::arg("carrier"));
  m.def(
      "lazy_read_loop",
      [](py::handle t, int64_t n) {
        const uintptr_t impl = ImplAddress(t.ptr());
        int64_t ok = 0;
        LazyFacts f;
        for (int64_t i = 0; i < n; ++i) ok += impl != 0 && ReadLazyFacts(impl, &f);
        return ok;
      },
      py::arg("tensor"), py::arg("n"), "Benchmarks: reads `tensor`'s facts `n` times.");
}

}  // namespace torch_xla_donate
