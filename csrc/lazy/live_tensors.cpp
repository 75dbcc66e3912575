// See live_tensors.h.  Includes torch's lazy-tensor headers; what it calls
// out of line (DeviceContextArena::ForAllDeviceContexts, torch::lazy::
// getBackend(), LazyTensor::data()) lives in libtorch_cpu.
#include "lazy/live_tensors.h"

#include <pybind11/pybind11.h>
#include <torch/csrc/lazy/backend/backend_data.h>
#include <torch/csrc/lazy/backend/backend_interface.h>
#include <torch/csrc/lazy/core/ir.h>
#include <torch/csrc/lazy/core/lazy_graph_executor.h>
#include <torch/csrc/lazy/core/tensor.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <typeinfo>
#include <utility>

#include "base/prefetch.h"
#include "base/scratch.h"
#include "base/tensor_access.h"
#include "lazy/lazy_tensor_of.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

using torch::lazy::LazyTensor;

// DeviceContextArena is a protected member type of LazyGraphExecutor and
// its walk a protected member: named through these accessors, never
// instantiated.
struct ExecutorAccess : torch::lazy::LazyGraphExecutor {
  using ArenaType = torch::lazy::LazyGraphExecutor::DeviceContextArena;
};
using Arena = ExecutorAccess::ArenaType;
struct ArenaAccess : Arena {
  using Arena::DeviceContext;
  static void ForAll(Arena* arena, const std::function<void(DeviceContext*)>& fn) {
    (arena->*(&ArenaAccess::ForAllDeviceContexts))(fn, /*device=*/nullptr);
  }
};

constexpr char kArenaName[] = "torch_xla::XLAGraphExecutor::DeviceContextArena";

std::atomic<uintptr_t> g_arena{0};

uintptr_t Address(const void* p) { return reinterpret_cast<uintptr_t>(p); }

// The buffer a device_data node holds (a virtual call into torch_xla).
uintptr_t NodeBuffer(const torch::lazy::Node* node) {
  torch::lazy::BackendDataPtr buffer = torch::lazy::getBackend()->GetComputationDataFromNode(node);
  return Address(buffer.get());
}

void Describe(const LazyTensor::Data& data, LiveTensor* out) {
  *out = LiveTensor();
  out->tensor_id = data.unique_id;
  out->data = Address(&data);
  out->handle = Address(data.handle.get());
  const torch::lazy::Node* node = data.ir_value.node.get();
  out->ir_node = Address(node);
  out->ir_is_device_data = node != nullptr && node->op().op == DeviceDataOp();
  // With a handle of its own the node's buffer is not asked (a virtual call
  // per tensor): only a tensor without one reads another's.
  if (out->ir_is_device_data && out->handle == 0) out->device_data_buffer = NodeBuffer(node);
}

}  // namespace

std::string ArenaTypeName(uintptr_t address) {
  if (address == 0) return "";
  try {
    return Demangled(typeid(*reinterpret_cast<Arena*>(address)).name());
  } catch (const std::exception&) {
    return "";
  }
}

bool SetLiveTensorArena(uintptr_t arena, std::string* why) {
  if (arena != 0) {
    const std::string name = ArenaTypeName(arena);
    if (name != kArenaName) {
      *why = "the object at the arena's address is a '" + name + "', not a " + kArenaName;
      g_arena.store(0, std::memory_order_release);
      return false;
    }
  }
  g_arena.store(arena, std::memory_order_release);
  return true;
}

uintptr_t LiveTensorArena() { return g_arena.load(std::memory_order_acquire); }

bool ForEachLiveTensor(const std::function<void(const LiveTensor&)>& visit) {
  const uintptr_t arena = LiveTensorArena();
  if (arena == 0) return false;
  // Released only after the locks are (see live_tensors.h); the thread's
  // scratch (base/scratch.h).
  Scratch<std::shared_ptr<LazyTensor::Data>> alive_of;
  std::vector<std::shared_ptr<LazyTensor::Data>>& alive = *alive_of;
  ArenaAccess::ForAll(reinterpret_cast<Arena*>(arena), [&](ArenaAccess::DeviceContext* ctx) {
    std::lock_guard<std::mutex> lock(ctx->lock);
    const size_t first = alive.size();
    alive.reserve(first + ctx->tensors_data.size());
    // Three passes, so that the loads of all tensors overlap rather than
    // wait for each other (lazy_reads.h PrefetchLazy): each Data, then its
    // IR node, then the reads.
    for (auto& entry : ctx->tensors_data) {
      alive.push_back(entry.second.lock());
      if (alive.back()) PrefetchBytes(alive.back().get(), sizeof(LazyTensor::Data));
    }
    for (size_t i = first; i < alive.size(); ++i)
      if (alive[i] && alive[i]->ir_value.node) __builtin_prefetch(alive[i]->ir_value.node.get());
    LiveTensor live;
    for (size_t i = first; i < alive.size(); ++i) {
      if (!alive[i]) continue;
      Describe(*alive[i], &live);
      visit(live);
    }
  });
  return true;
}

bool DonorKeyOf(uintptr_t impl, DonorKey* key) {
  *key = DonorKey();
  try {
    bool functional = false;
    LazyTensor* lazy = XlaLazyTensorOf(impl, &functional);
    if (lazy == nullptr) return false;
    LiveTensor live;
    Describe(*lazy->data(), &live);
    key->tensor_id = live.tensor_id;
    key->own_handle = live.handle != 0;
    key->buffer = key->own_handle ? live.handle : live.device_data_buffer;
    key->ir_node = live.ir_is_device_data ? live.ir_node : 0;
    return key->buffer != 0;
  } catch (...) {
    *key = DonorKey();
    return false;
  }
}

bool DonorKeyOfFacts(const LazyFacts& facts, DonorKey* key) {
  *key = DonorKey();
  if (facts.buffer == 0) return false;
  key->tensor_id = facts.tensor_id;
  key->own_handle = facts.has_handle;
  key->buffer = facts.buffer;
  key->ir_node = facts.ir_is_device_data ? facts.ir_node : 0;
  return true;
}

bool SameStepCopies(const std::vector<DonorKey>& donors, std::vector<std::vector<int64_t>>* out) {
  out->assign(donors.size(), {});
  using Key = std::pair<uintptr_t, size_t>;  // (node or buffer, donor index)
  // The thread's scratch (base/scratch.h): no block of malloc's per step.
  Scratch<Key, struct NodesTag> nodes_of;
  Scratch<Key, struct BuffersTag> buffers_of;
  Scratch<Key, struct BorrowedTag> borrowed_of;  // donors without a handle
  Scratch<int64_t, struct IdsTag> ids_of;
  std::vector<Key>& nodes = *nodes_of;
  std::vector<Key>& buffers = *buffers_of;
  std::vector<Key>& borrowed = *borrowed_of;
  std::vector<int64_t>& ids = *ids_of;
  for (auto* keys : {&nodes, &buffers}) keys->reserve(donors.size());
  ids.reserve(donors.size());
  for (size_t i = 0; i < donors.size(); ++i) {
    const DonorKey& d = donors[i];
    if (d.buffer == 0) continue;
    ids.push_back(d.tensor_id);
    buffers.emplace_back(d.buffer, i);
    if (!d.own_handle || d.match_handle) borrowed.emplace_back(d.buffer, i);
    if (d.ir_node != 0) nodes.emplace_back(d.ir_node, i);
  }
  if (buffers.empty()) return LiveTensorArena() != 0;
  // Sorted at the first live tensor that must be looked up: in the common
  // step every live tensor is either materialized with a buffer of its own
  // or pending, and none is.
  bool sorted = false;
  // Donors holding each other's buffer are donated together: not holders.
  auto record = [&](const std::vector<Key>& keys, uintptr_t key, int64_t id) {
    if (!sorted) {
      for (auto* k : {&nodes, &buffers, &borrowed}) std::sort(k->begin(), k->end());
      std::sort(ids.begin(), ids.end());
      sorted = true;
    }
    if (std::binary_search(ids.begin(), ids.end(), id)) return;
    for (auto it = std::lower_bound(keys.begin(), keys.end(), Key(key, 0));
         it != keys.end() && it->first == key; ++it) {
      auto& found = (*out)[it->second];
      if (found.empty() || found.back() != id) found.push_back(id);
    }
  };
  return ForEachLiveTensor([&](const LiveTensor& t) {
    if (t.handle != 0) {
      // Its own buffer: kept at the barrier, unless it is a donor's that
      // has none (the donor is itself a copy of it) or that matches handles.
      if (!borrowed.empty()) record(borrowed, t.handle, t.tensor_id);
      return;
    }
    if (t.ir_node == 0 || !t.ir_is_device_data) return;  // pending: computed anew
    record(nodes, t.ir_node, t.tensor_id);
    record(buffers, t.device_data_buffer, t.tensor_id);
  });
}

void RegisterLiveTensors(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  m.attr("LIVE_ARENA_TYPE") = py::str(kArenaName);
  m.def("live_arena_type_name", &ArenaTypeName, py::arg("address"),
        "The demangled dynamic type of the object at `address` ('' for 0).");
  m.def(
      "live_set_arena",
      [](uintptr_t arena) {
        std::string why;
        return SetLiveTensorArena(arena, &why) ? std::string() : why;
      },
      py::arg("arena"),
      "Accepts torch_xla's DeviceContextArena at `arena` (checked by its RTTI): '' or why "
      "not.  0 turns the walk off.");
  m.def("live_arena", &LiveTensorArena, "The accepted arena's address; 0: the walk is off.");
  m.def(
      "live_tensors",
      []() -> py::object {
        std::vector<LiveTensor> all;
        bool on;
        {
          py::gil_scoped_release no_gil;
          on = ForEachLiveTensor([&](const LiveTensor& t) { all.push_back(t); });
        }
        if (!on) return py::none();
        py::list out;
        for (const LiveTensor& t : all)
          out.append(py::make_tuple(t.tensor_id, t.handle, t.ir_node, t.ir_is_device_data,
                                    t.device_data_buffer));
        return out;
      },
      "Every live XLA tensor as (tensor_id, handle, ir_node, ir_is_device_data, "
      "device_data_buffer) (live_tensors.h LiveTensor), or None when the walk is off.");
  m.def(
      "live_count",
      []() -> py::object {
        size_t n = 0;
        bool on;
        {
          py::gil_scoped_release no_gil;
          on = ForEachLiveTensor([&](const LiveTensor&) { ++n; });
        }
        return on ? py::object(py::int_(n)) : py::none();
      },
      "How many XLA tensors are live (all devices); None when the walk is off.");
  m.def(
      "same_step_copies",
      [](py::sequence donors, bool with_handles) -> py::object {
        const size_t n = py::len(donors);
        std::vector<DonorKey> keys(n);
        std::vector<bool> read(n, false);
        for (size_t i = 0; i < n; ++i) {
          const uintptr_t impl = ImplAddress(py::object(donors[i]).ptr());
          read[i] = impl != 0 && DonorKeyOf(impl, &keys[i]);
          keys[i].match_handle = with_handles;
        }
        std::vector<std::vector<int64_t>> found;
        bool on;
        {
          py::gil_scoped_release no_gil;
          on = SameStepCopies(keys, &found);
        }
        if (!on) return py::none();
        // Sparse: nothing per donor that has no copy (every donor, mostly).
        py::dict out;
        for (size_t i = 0; i < n; ++i) {
          if (!read[i]) {
            out[py::int_(i)] = py::none();
          } else if (!found[i].empty()) {
            py::list holders;
            for (int64_t id : found[i]) holders.append(py::int_(id));
            out[py::int_(i)] = std::move(holders);
          }
        }
        return std::move(out);
      },
      py::arg("donors"), py::arg("with_handles") = false,
      "{index: ids} for the donors with copies: the torch_xla ids of the live tensors other "
      "than the donors whose value the barrier takes from its buffer (copies made since the "
      "last barrier); {index: None} for a donor that cannot be read (check it another way); "
      "donors with neither are left out.  None when the walk is off.");
}

}  // namespace torch_xla_donate
