// Dead step inputs (automatic donation, the advisor): buffers the coming barrier reads that only
// its IR holds (its device_data node, and this walk).  A miss errs towards "held".
#include <pybind11/stl.h>
#include <torch/csrc/lazy/backend/backend_interface.h>
#include <torch/csrc/lazy/core/hash.h>
#include <torch/csrc/lazy/core/ir.h>
#include <torch/csrc/lazy/core/lazy_graph_executor.h>

#include <chrono>
#include <tuple>
#include <unordered_set>

#include "lazy.h"

namespace torch_xla_donate {
namespace {

using torch::lazy::BackendDataPtr;
using torch::lazy::LazyTensor;
using torch::lazy::Node;

// One dead input: its buffer (held from the search to its verdict) and what describes it.
struct Dead {
  BackendDataPtr buffer;
  size_t index = 0;       // among the graph's device-data nodes, in the search's order
  std::string node_text;  // the device-data node's ToString (its xla_shape)
  std::vector<std::tuple<std::string, std::string, int>> frames;  // file, function, line
};

// The result of one search; Python keeps it from the commit that armed it to its verdict.
class DeadInputs {
 public:
  size_t live = 0, pending = 0, nodes = 0;
  size_t aliased = 0;  // dead, but torch_xla's own aliasing reuses them
  size_t blocked = 0;  // not 0-dim, unheld by the walk, but a count or write the walk cannot see
  double seconds = 0;
  std::string graph;  // the pending IR's hash: the same graph, the same key
  std::vector<Dead> dead;

  py::list Describe() const {  // (node text, frames) per dead input
    py::list out;
    for (const Dead& d : dead) out.append(py::make_tuple(d.node_text, py::cast(d.frames)));
    return out;
  }

  // Points `carrier` at dead input `i`'s buffer, for Python to arm and restore the carrier.
  bool Point(py::handle carrier, size_t i) {
    if (i >= dead.size()) throw py::index_error("no such dead input");
    return PointCarrier(carrier.ptr(), dead[i].buffer);
  }

  std::vector<size_t> Indices() const {
    std::vector<size_t> out;
    out.reserve(dead.size());
    for (const Dead& d : dead) out.push_back(d.index);
    return out;
  }

  std::vector<bool> Consumed() const {  // per dead input: the step took its buffer
    std::vector<bool> out;
    out.reserve(dead.size());
    for (const Dead& d : dead) out.push_back(d.buffer && !d.buffer->HasValue());
    return out;
  }

  void Keep(const std::vector<bool>& mask) {
    if (mask.size() != dead.size()) throw py::value_error("mask differs in length");
    std::vector<Dead> kept;
    for (size_t i = 0; i < dead.size(); ++i)
      if (mask[i]) kept.push_back(std::move(dead[i]));
    dead = std::move(kept);
  }
};

// A device-data node's text names a 0-dim buffer ("xla_shape=f32[]{}"): never donated.
bool IsZeroDim(const std::string& text) {
  const size_t shape = text.find("xla_shape=");
  const size_t open = shape == std::string::npos ? shape : text.find('[', shape);
  return open != std::string::npos && open + 1 < text.size() && text[open + 1] == ']';
}

// Visits each node reachable from `roots` once; `visit(node)`: whether to go into its operands.
template <typename Visit>
void VisitIr(const std::vector<torch::lazy::NodePtr>& roots, Visit visit) {
  std::unordered_set<const Node*> visited;
  std::vector<const Node*> stack;
  for (const torch::lazy::NodePtr& root : roots)
    if (visited.insert(root.get()).second) stack.push_back(root.get());
  while (!stack.empty()) {
    const Node* node = stack.back();
    stack.pop_back();
    if (!visit(node)) continue;
    for (const torch::lazy::Output& operand : node->operands())
      if (operand.node && visited.insert(operand.node).second) stack.push_back(operand.node);
  }
}

// The search.  `describe`: keep each dead node's source frames (only with XLA_IR_DEBUG).
std::unique_ptr<DeadInputs> FindDeadInputs(bool describe) {
  const auto start = std::chrono::steady_clock::now();
  auto out = std::make_unique<DeadInputs>();
  const c10::Symbol device_data = DeviceDataOp();
  // The pending tensors' IR nodes, owned: the walk keeps each Data alive only while visited.
  std::vector<torch::lazy::NodePtr> roots, kept;
  std::vector<size_t> root_outputs;            // which output of its root node each reads
  std::unordered_set<const Node*> held_nodes;  // device-data nodes live tensors hold
  std::unordered_set<int64_t> outputs;         // ids of the pending tensors
  bool walked = false;
  {
    py::gil_scoped_release no_gil;  // the registry's lock is taken
    walked = ForEachLiveTensor([&](const LiveTensor& t) {
      ++out->live;
      if (t.ir_node == 0) return;
      if (t.ir_is_device_data) {
        held_nodes.insert(reinterpret_cast<const Node*>(t.ir_node));
      } else if (t.handle == 0) {
        // Pending: the barrier computes it.  Its Data is alive here.
        const auto& data = *reinterpret_cast<const LazyTensor::Data*>(t.data);
        roots.push_back(data.ir_value.node);
        root_outputs.push_back(data.ir_value.index);
        outputs.insert(data.unique_id);
      } else {
        // A buffer and IR that is not device data: the barrier leaves it, so its IR's reads stay.
        kept.push_back(reinterpret_cast<const LazyTensor::Data*>(t.data)->ir_value.node);
      }
    });
  }
  if (!walked) throw py::value_error("the live-tensor registry walk is off");
  out->pending = roots.size();
  torch::lazy::hash_t graph = torch::lazy::Hash(static_cast<uint64_t>(roots.size()));
  for (size_t i = 0; i < roots.size(); ++i)
    graph = torch::lazy::HashCombine(
        graph, torch::lazy::HashCombine(roots[i]->hash(), static_cast<uint64_t>(root_outputs[i])));
  out->graph = torch::lazy::HashToString(graph);
  const torch::lazy::BackendImplInterface* backend = torch::lazy::getBackend();
  // IR the barrier does not compute: every device-data node it reads is held.
  VisitIr(kept, [&](const Node* node) {
    if (node->op().op == device_data) held_nodes.insert(node);
    return true;
  });
  std::unordered_set<const torch::lazy::BackendData*> seen;
  size_t index = 0;
  // A device-data node ends its branch, dead or not.
  VisitIr(roots, [&](const Node* node) {
    ++out->nodes;
    if (node->op().op != device_data) return true;
    const size_t this_index = index++;
    if (held_nodes.count(node)) return false;
    BackendDataPtr buffer = backend->GetComputationDataFromNode(node);
    if (!buffer || !seen.insert(buffer.get()).second) return false;
    // The node's own holder and this copy: nothing else.  An execution still running holds its
    // arguments and writes its outputs: Python waits and asks again when any is blocked so.
    if (buffer.use_count() != 2 || !buffer->HasValue()) {
      if (!IsZeroDim(node->ToString())) ++out->blocked;
      return false;
    }
    // torch_xla aliases it to an output itself (arming it too would change nothing).
    auto* info = dynamic_cast<torch::lazy::LazyGraphExecutor::DeviceDataInfo*>(buffer->info());
    if (info != nullptr && !info->read_only && outputs.count(info->tensor_id)) {
      ++out->aliased;
      return false;
    }
    Dead d;
    d.buffer = std::move(buffer);
    d.index = this_index;
    d.node_text = node->ToString();
    if (describe)
      for (const auto& f : node->metadata().frame_info)
        d.frames.emplace_back(f.file, f.function, f.line);
    out->dead.push_back(std::move(d));
    return false;
  });
  out->seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return out;
}

}  // namespace

void RegisterDeadInputs(py::module_& m) {
  py::class_<DeadInputs>(m, "DeadInputs")
      .def("__len__", [](const DeadInputs& d) { return d.dead.size(); })
      .def_readonly("live", &DeadInputs::live, "live XLA tensors walked")
      .def_readonly("pending", &DeadInputs::pending, "of them pending (the IR roots)")
      .def_readonly("nodes", &DeadInputs::nodes, "IR nodes visited")
      .def_readonly("aliased", &DeadInputs::aliased, "dead inputs torch_xla aliases itself")
      .def_readonly("blocked", &DeadInputs::blocked, "inputs held by what the walk cannot see")
      .def_readonly("seconds", &DeadInputs::seconds, "time the search took")
      .def_readonly("graph", &DeadInputs::graph, "the pending IR's hash")
      .def("indices", &DeadInputs::Indices)
      .def("describe", &DeadInputs::Describe)
      .def("point", &DeadInputs::Point, py::arg("carrier"), py::arg("index"))
      .def("consumed", &DeadInputs::Consumed)
      .def("keep", &DeadInputs::Keep, py::arg("mask"))
      .def("release", [](DeadInputs& d) { d.dead.clear(); });
  m.def("find_dead_inputs", &FindDeadInputs, py::arg("describe") = false,
        "The device buffers the pending IR reads that nothing else holds.");
}

}  // namespace torch_xla_donate
