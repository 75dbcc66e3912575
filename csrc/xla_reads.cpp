// What torch_xla knows about an XLA tensor, behind the one layout fact (docs/design.md, "Reading
// torch_xla"); every read checks the vtable learned, under an RTTI check, from a known XLA tensor.
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

// Where a c10::TensorImpl subclass puts its first member (the compiler's layout, not a number).
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

// What torch_xla sees: a functional wrapper's value; null for one with updates not applied yet.
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

std::string LearnXlaTensorType(uintptr_t address) {  // the guard: "" or why not
  try {
    bool functional = false;
    c10::TensorImpl* impl = Unwrapped(reinterpret_cast<c10::TensorImpl*>(address), &functional);
    if (impl == nullptr) return "the sample tensor's functional wrapper is not up to date";
    const std::string name = Demangled(typeid(*impl).name());
    if (name != "torch_xla::XLATensorImpl")
      return "the sample tensor is a " + name + ", not a torch_xla::XLATensorImpl";
    LazyTensor* lazy = FirstMember(impl);
    const std::string member = lazy ? Demangled(typeid(*lazy).name()) : "null";
    if (member != "torch_xla::XLATensor")
      return "torch_xla::XLATensorImpl's first member is a " + member +
             ", not a torch_xla::XLATensor";
    g_xla_impl_vtable.store(VtableOf(impl), std::memory_order_release);
    return "";
  } catch (const std::exception& e) {
    return std::string("learning the XLA tensor type raised: ") + e.what();
  }
}

// Each carrier's own handle while it points at another buffer (point_carrier to restore_carrier).
std::unordered_map<LazyTensor*, torch::lazy::BackendDataPtr> g_carried;

LazyTensor* CarrierOf(PyObject* carrier) {
  const uintptr_t address = ImplAddress(carrier);
  bool functional = false;
  return address == 0 ? nullptr : XlaLazyTensorOf(address, &functional);
}

// -- Bindings: every per-tensor read answers None when it declines ----------
bool ReadMaybeForced(py::handle t, bool force, LazyFacts* facts) {
  if (!force) return ReadLazy(t.ptr(), facts);
  const uintptr_t impl = ImplAddress(t.ptr());
  return impl != 0 && ReadLazyFacts(impl, facts);
}

// Per tensor, `answer(facts)`, or None when the read declines.
template <typename Answer>
py::list PerTensor(py::iterable tensors, bool force, Answer answer) {
  py::list out;
  for (py::handle t : tensors) {
    LazyFacts f;
    out.append(ReadMaybeForced(t, force, &f) ? answer(f) : py::object(py::none()));
  }
  return out;
}

// One-tensor reads with the CPython API: pybind11's dispatch would cost what the read saves.
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

int64_t BufferHandle(uintptr_t address) {
  auto* buffer = reinterpret_cast<BackendData*>(address);
  try {  // GetHandle refuses a deleted buffer
    return buffer != nullptr && buffer->HasValue() ? buffer->GetHandle() : 0;
  } catch (...) {
    return 0;
  }
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

bool ReadLazyFacts(uintptr_t impl, LazyFacts* out) {
  *out = LazyFacts();
  try {
    if (Read(impl, out)) return true;
  } catch (...) {
  }
  *out = LazyFacts();
  return false;
}

bool LazyReadsEnabled() { return g_enabled.load(std::memory_order_acquire); }

bool ReadLazy(PyObject* t, LazyFacts* facts) {
  if (!LazyReadsEnabled()) return false;
  const uintptr_t impl = ImplAddress(t);
  return impl != 0 && ReadLazyFacts(impl, facts);
}

int BufferDeleted(PyObject* t) {
  LazyFacts facts;
  if (ReadLazy(t, &facts)) return facts.consumed() ? 1 : 0;
  PyErr_SetString(PyExc_TypeError, "torch_xla_donate cannot read this tensor's device buffer");
  return -1;
}

const torch::lazy::BackendData* AsData(const HeldBuffer& buffer) {
  return static_cast<const torch::lazy::BackendData*>(buffer.get());
}

HeldBuffer TakeBuffer(uintptr_t address) {
  try {
    bool functional = false;
    LazyTensor* lazy = XlaLazyTensorOf(address, &functional);
    if (lazy == nullptr) return nullptr;
    return lazy->data()->handle;  // shares its control block: no allocation
  } catch (...) {
    return nullptr;
  }
}

bool HeldBufferConsumed(const HeldBuffer& buffer) { return !AsData(buffer)->HasValue(); }

bool PointCarrier(PyObject* carrier, const torch::lazy::BackendDataPtr& buffer) {
  LazyTensor* lazy = CarrierOf(carrier);
  if (lazy == nullptr || !buffer || g_carried.count(lazy)) return false;
  const std::shared_ptr<LazyTensor::Data>& data = lazy->data();
  g_carried.emplace(lazy, std::move(data->handle));
  data->handle = buffer;
  return true;
}

void RegisterXlaReads(py::module_& m) {
  Check(PyModule_AddFunctions(m.ptr(), kMethods) == 0);
  m.attr("LAZY_FACT_FIELDS") =
      py::make_tuple("is_functional", "tensor_id", "has_handle", "has_value", "has_ir",
                     "ir_is_device_data", "pending", "buffer_use_count", "expected_holders",
                     "owner_tensor_id", "xla_tensor_refcount", "buffer", "handle");
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
        return PerTensor(tensors, force, [](const LazyFacts& f) -> py::object {
          if (!f.has_handle || !f.is_functional) return py::none();  // holders unseen
          return py::make_tuple(f.expected_holders, f.buffer_use_count, f.xla_tensor_refcount);
        });
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
        // torch_xla's owner query without side effects: a handle and no IR is filed under itself.
        return PerTensor(tensors, force, [](const LazyFacts& f) -> py::object {
          const bool bare = f.has_handle && !f.has_ir;
          if (!f.has_value || (!bare && !f.ir_is_device_data)) return py::none();
          return py::int_(bare ? f.tensor_id : f.owner_tensor_id);
        });
      },
      py::arg("tensors"), py::arg("force") = false,
      "Per tensor, the id torch_xla's owner query files its live buffer under, or None.");
  m.def(
      "lazy_learn",
      [](py::handle t) -> std::string {
        const uintptr_t impl = ImplAddress(t.ptr());
        return impl != 0 ? LearnXlaTensorType(impl) : "the sample is no torch.Tensor";
      },
      py::arg("tensor"), "Learns XLATensorImpl's type from an XLA tensor: '' or why not.");
  m.def(
      "lazy_set_enabled", [](bool on) { g_enabled.store(on, std::memory_order_release); },
      py::arg("on"));
  m.def(
      "pending_flags",
      [](py::list tensors) {
        py::list out;
        for (py::handle t : tensors) {
          TensorFacts facts;
          if (Facts(t.ptr(), &facts, false) != 1 || !facts.is_xla)
            throw py::type_error(std::string("pending_flags() takes XLA tensors, got a ") +
                                 Py_TYPE(t.ptr())->tp_name);
          LazyFacts f;  // declined: no plain device data, pending
          out.append(py::bool_(!ReadLazy(t.ptr(), &f) || f.pending));
        }
        return out;
      },
      py::arg("tensors"), "Pending computation per XLA tensor (declined: pending).");
  m.def(
      "point_carrier",
      [](py::handle carrier, py::handle entry) {
        const HeldBuffer* buffer = EntryBuffer(entry.ptr());
        return buffer != nullptr &&
               PointCarrier(carrier.ptr(),
                            std::static_pointer_cast<torch::lazy::BackendData>(*buffer));
      },
      py::arg("carrier"), py::arg("entry"),
      "Points `carrier` at the buffer a released entry keeps; False when it keeps none.");
  m.def(
      "restore_carrier",
      [](py::handle carrier) {
        LazyTensor* lazy = CarrierOf(carrier.ptr());
        auto it = lazy == nullptr ? g_carried.end() : g_carried.find(lazy);
        if (it == g_carried.end()) return false;
        lazy->data()->handle = std::move(it->second);
        g_carried.erase(it);
        return true;
      },
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
