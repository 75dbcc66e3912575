// torch_xla's registry of live tensors, walked natively (docs/design.md, "The live-tensor
// registry").
#include <pybind11/stl.h>
#include <torch/csrc/lazy/backend/backend_interface.h>
#include <torch/csrc/lazy/core/ir.h>
#include <torch/csrc/lazy/core/lazy_graph_executor.h>

#include <algorithm>
#include <atomic>
#include <typeinfo>
#include <unordered_map>

#include "lazy.h"

namespace torch_xla_donate {
namespace {

using torch::lazy::LazyTensor;

// DeviceContextArena and its walk are protected: named through these accessors, never made.
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

void Describe(const LazyTensor::Data& data, LiveTensor* out) {
  *out = LiveTensor();
  out->tensor_id = data.unique_id;
  out->data = Address(&data);
  out->handle = Address(data.handle.get());
  const torch::lazy::Node* node = data.ir_value.node.get();
  out->ir_node = Address(node);
  out->ir_is_device_data = node != nullptr && node->op().op == DeviceDataOp();
  if (out->ir_is_device_data && out->handle == 0)  // only then another's buffer
    out->device_data_buffer =
        Address(torch::lazy::getBackend()->GetComputationDataFromNode(node).get());
}

std::string ArenaTypeName(uintptr_t address) {
  try {
    return address ? Demangled(typeid(*reinterpret_cast<Arena*>(address)).name()) : "";
  } catch (const std::exception&) {
    return "";
  }
}

bool WalkWithoutGil(const std::function<void(const LiveTensor&)>& visit) {
  py::gil_scoped_release no_gil;
  return ForEachLiveTensor(visit);
}

}  // namespace

bool ForEachLiveTensor(const std::function<void(const LiveTensor&)>& visit) {
  const uintptr_t arena = g_arena.load(std::memory_order_acquire);
  if (arena == 0) return false;
  // A tensor dying under its device's lock would unregister under it: each is kept until unlocked.
  std::vector<std::shared_ptr<LazyTensor::Data>> alive;
  ArenaAccess::ForAll(reinterpret_cast<Arena*>(arena), [&](ArenaAccess::DeviceContext* ctx) {
    std::lock_guard<std::mutex> lock(ctx->lock);
    LiveTensor live;
    for (auto& entry : ctx->tensors_data) {
      alive.push_back(entry.second.lock());
      if (!alive.back()) continue;
      Describe(*alive.back(), &live);
      visit(live);
    }
  });
  return true;
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

bool SameStepCopies(const std::vector<DonorKey>& donors, const std::vector<int64_t>& skip,
                    std::vector<std::vector<int64_t>>* out) {
  out->assign(donors.size(), {});
  using Key = std::pair<uintptr_t, size_t>;   // (node or buffer, donor)
  std::vector<Key> nodes, buffers, borrowed;  // borrowed: match live handles too
  std::vector<int64_t> ids(skip);             // donated together, or skipped
  for (auto* k : {&nodes, &buffers, &borrowed}) k->reserve(donors.size());
  ids.reserve(skip.size() + donors.size());
  for (size_t i = 0; i < donors.size(); ++i) {
    const DonorKey& d = donors[i];
    if (d.buffer == 0) continue;
    ids.push_back(d.tensor_id);
    buffers.emplace_back(d.buffer, i);
    if (!d.own_handle || d.match_handle) borrowed.emplace_back(d.buffer, i);
    if (d.ir_node != 0) nodes.emplace_back(d.ir_node, i);
  }
  if (buffers.empty()) return g_arena.load() != 0;
  // Sorted at the first live tensor needing a lookup: in the common step none does.
  bool sorted = false;
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
      if (!borrowed.empty()) record(borrowed, t.handle, t.tensor_id);
      return;
    }
    if (t.ir_node == 0 || !t.ir_is_device_data) return;  // pending: computed anew
    record(nodes, t.ir_node, t.tensor_id);
    record(buffers, t.device_data_buffer, t.tensor_id);
  });
}

std::vector<long> ExcessHolders(const std::vector<LazyFacts>& facts) {
  std::vector<long> extra(facts.size(), 0);
  if (std::all_of(facts.begin(), facts.end(),
                  [](const LazyFacts& f) { return f.only_own_holders(); }))
    return extra;
  // Donors sharing a buffer are judged together: each accounts for its own.
  std::unordered_map<uintptr_t, std::vector<size_t>> groups;
  for (size_t i = 0; i < facts.size(); ++i)
    groups[facts[i].has_value ? facts[i].buffer : ~uintptr_t{i}].push_back(i);
  for (const auto& [buffer, members] : groups) {
    long allowed = 0, refs = 0;
    for (size_t m : members) {
      allowed += facts[m].expected_holders;
      refs = std::max(refs, facts[m].xla_tensor_refcount);
    }
    const long over = std::max(facts[members[0]].buffer_use_count - allowed,
                               refs - static_cast<long>(members.size()));
    if (over > 0)
      for (size_t m : members) extra[m] = over;
  }
  return extra;
}

void RegisterLiveTensors(py::module_& m) {
  m.def(
      "live_set_arena",
      [](uintptr_t arena) -> std::string {
        const std::string name = ArenaTypeName(arena);
        const bool ok = arena == 0 || name == kArenaName;
        g_arena.store(ok ? arena : 0, std::memory_order_release);
        return ok ? ""
                  : "the object at the arena's address is a '" + name + "', not a " + kArenaName;
      },
      py::arg("arena"), "Accepts the arena at `arena` (its RTTI checked): '' or why not.");
  m.def("live_arena", []() { return g_arena.load(); }, "The accepted arena; 0: walk off.");
  m.def("live_tensors", []() -> py::object {
    std::vector<LiveTensor> all;
    if (!WalkWithoutGil([&](const LiveTensor& t) { all.push_back(t); })) return py::none();
    py::list out;
    for (const LiveTensor& t : all)
      out.append(py::make_tuple(t.tensor_id, t.handle, t.ir_node, t.ir_is_device_data,
                                t.device_data_buffer));
    return out;
  });
  m.def("live_count", []() -> py::object {
    size_t n = 0;
    if (!WalkWithoutGil([&](const LiveTensor&) { ++n; })) return py::none();
    return py::int_(n);
  });
  m.def(
      "same_step_copies",
      [](py::sequence donors, bool with_handles) -> py::object {
        const size_t n = py::len(donors);
        std::vector<DonorKey> keys(n);
        std::vector<bool> read(n, false);
        for (size_t i = 0; i < n; ++i) {
          LazyFacts f;
          const uintptr_t impl = ImplAddress(py::object(donors[i]).ptr());
          read[i] = impl != 0 && ReadLazyFacts(impl, &f) && DonorKeyOfFacts(f, &keys[i]);
          keys[i].match_handle = with_handles;
        }
        std::vector<std::vector<int64_t>> found;
        if (![&] {
              py::gil_scoped_release no_gil;
              return SameStepCopies(keys, {}, &found);
            }())
          return py::none();
        py::dict out;  // sparse: the donors with copies, or unreadable (None)
        for (size_t i = 0; i < n; ++i)
          if (!read[i] || !found[i].empty())
            out[py::int_(i)] = read[i] ? py::cast(found[i]) : py::object(py::none());
        return std::move(out);
      },
      py::arg("donors"), py::arg("with_handles") = false,
      "{index: ids of the live tensors backed by its buffer} for donors with copies, "
      "{index: None} for one that cannot be read; None when the walk is off.");
}

}  // namespace torch_xla_donate
