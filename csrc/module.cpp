// torch_xla_donate._C: the enums, the ledger's bindings and the hooks; files register the rest.
#include <pybind11/stl.h>

#include "reads.h"

namespace torch_xla_donate {
void RegisterMarking(py::module_& m);
void RegisterCommit(py::module_& m);
void RegisterTrampoline(py::module_& m);
void RegisterDeadInputs(py::module_& m);
}  // namespace torch_xla_donate

using namespace torch_xla_donate;

namespace {

void AddEnum(py::module_& m, const char* name, std::vector<const char*> members, const char* doc) {
  py::list items;
  for (size_t i = 0; i < members.size(); ++i) items.append(py::make_tuple(members[i], i));
  py::object e = py::module_::import("enum").attr("IntEnum")(
      name, items, py::arg("module") = "torch_xla_donate._C");
  e.attr("__doc__") = doc;
  m.attr(name) = e;
}

py::dict StatsDict(const StepStats& s) {
  py::dict d;
#define TDX_ITEMS(name) \
  d[#name] = s.name;    \
  d[#name "_bytes"] = s.name##_bytes;
  TDX_COUNTERS(TDX_ITEMS)
#undef TDX_ITEMS
  d["step"] = s.step;
  d["steps"] = s.steps;
  d["in_flight"] = s.in_flight;
  d["unused_shapes"] = s.unused_shapes;
  return d;
}

py::object RecordOrNone(RecordPtr r) {
  return r ? py::reinterpret_steal<py::object>(WrapRecord(std::move(r))) : py::none();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "The native ledger and hot path of torch_xla_donate (docs/design.md).";
#define TDX_NAME(name) #name,
  AddEnum(m, "Verdict", {TDX_VERDICTS(TDX_NAME)},
          "What became of a donation; REUSED and LOST poison it.");
  AddEnum(m, "Via", {TDX_VIAS(TDX_NAME)}, "The call that marked a tensor.");
  AddEnum(m, "Refusal", {TDX_REFUSALS(TDX_NAME)},
          "Why marking refused a tensor (marking.cpp Classify).");
  AddEnum(m, "Split", {TDX_SPLITS(TDX_NAME)}, "What the commit made of a mark (commit.cpp).");
#undef TDX_NAME
  RegisterEntries(m);
  RegisterMarking(m);
  RegisterCommit(m);
  RegisterXlaReads(m);
  RegisterLiveTensors(m);
  RegisterPoison(m);
  RegisterTrampoline(m);
  RegisterDeadInputs(m);

  m.def(
      "bind",
      [](py::kwargs hooks) {
        for (auto [key, value] : hooks) {
          const std::string name = py::str(key);
          PyObject** slot = name == "tensor_type"           ? &g_hooks.tensor_type
                            : name == "donated_type"        ? &g_hooks.donated_type
                            : name == "on_donated_dispatch" ? &g_hooks.on_donated_dispatch
                            : name == "on_refusal"          ? &g_hooks.on_refusal
                                                            : nullptr;
          if (!slot) throw py::type_error("bind(): unknown hook '" + name + "'");
          Py_XSETREF(*slot, value.inc_ref().ptr());
        }
      },
      "Hands the native module the Python objects it needs (_native.py, at import).");
  m.def(
      "mark",
      [](py::object tensor, std::string file, int line, std::vector<int64_t> shape,
         std::string dtype, int64_t nbytes, int via, int64_t version) -> py::object {
        // Tests put marks straight into the ledger: refuse garbage.
        if (tensor.is_none()) throw py::type_error("mark() needs a tensor, got None");
        if (nbytes < 0 || via < 0 || via >= kViaCount)
          throw py::value_error("mark(): nbytes must be >= 0 and via a Via");
        for (int64_t d : shape)
          if (d < 0) throw py::value_error("mark(): shape sizes must be >= 0");
        RecordPtr record = NewRecord();
        record->file = std::make_shared<const std::string>(file);
        record->line = line;
        record->shape.assign(shape.begin(), shape.end());
        record->dtype = InternDtype(dtype);
        record->nbytes = nbytes;
        record->via = static_cast<Via>(via);
        record->version = version;
        return GlobalLedger().Mark(std::move(tensor), record) ? RecordOrNone(record) : py::none();
      },
      py::arg("tensor"), py::arg("file"), py::arg("line"), py::arg("shape"), py::arg("dtype"),
      py::arg("nbytes"), py::arg("via") = 0, py::arg("version") = -1,
      "Marks a tensor as it is, unchecked (tests); None if it is marked already.");
  m.def("unmark", [](py::object t) { return RecordOrNone(GlobalLedger().Unmark(t)); });
  m.def("is_marked", [](py::object t) { return GlobalLedger().IsMarked(t); });
  m.def("marked_tensors", []() { return GlobalLedger().MarkedTensors(); });
  m.def("marked_count", []() { return GlobalLedger().MarkedCount(); });
  m.def(
      "begin_step",
      [](py::object only) {
        std::vector<PyObject*> keys;
        if (!only.is_none())
          for (auto t : only) keys.push_back(t.ptr());
        std::vector<py::object> tensors;
        std::vector<RecordPtr> records;
        const int64_t step =
            GlobalLedger().BeginStep(&tensors, &records, only.is_none() ? nullptr : &keys);
        py::list recs;
        for (RecordPtr& r : records) recs.append(RecordOrNone(std::move(r)));
        return py::make_tuple(step, py::cast(tensors), recs);
      },
      py::arg("only") = py::none(), "Takes the marks into a new step, unjudged (tests).");
  m.def(
      "settle",
      [](py::handle record, int verdict) {
        if (verdict < static_cast<int>(Verdict::REUSED) || verdict >= kVerdictCount)
          throw py::value_error("settle() needs a final verdict");
        GlobalLedger().Settle(RecordArg(record.ptr()).get(), static_cast<Verdict>(verdict));
      },
      py::arg("record"), py::arg("verdict"));
  m.def("current_step", []() { return GlobalLedger().current_step(); });
  m.def(
      "step_stats",
      [](int64_t step) -> py::object {
        StepStats s;
        return GlobalLedger().Stats(step, &s) ? py::object(StatsDict(s)) : py::none();
      },
      py::arg("step") = -1);
  m.def(
      "history",
      [](int64_t since) {
        py::list out;
        for (const StepStats& s : GlobalLedger().History(since)) out.append(StatsDict(s));
        return out;
      },
      py::arg("since") = 0);
  m.def("totals", []() { return StatsDict(GlobalLedger().Totals()); });
  m.def("generation", []() { return GlobalLedger().generation(); });
  m.def("reset", []() { GlobalLedger().Reset(); });
  m.attr("HISTORY_STEPS") = Ledger::kHistorySteps;
#ifndef TDX_BUILT_FOR_TORCH
#define TDX_BUILT_FOR_TORCH py::none()  // a build that did not say (Bazel)
#endif
  m.attr("BUILT_FOR_TORCH") = TDX_BUILT_FOR_TORCH;
  m.def("impl_address", [](py::handle t) { return ImplAddress(t.ptr()); });
  m.def("storage_address", [](py::handle t) -> uintptr_t {
    const uintptr_t impl = ImplAddress(t.ptr());
    return impl ? StorageAddress(impl) : 0;
  });
  m.def("use_counts", [](py::handle t) -> py::object {
    TensorFacts facts;
    if (Facts(t.ptr(), &facts, false) != 1) return py::none();
    return py::make_tuple(facts.storage_use_count, facts.impl_use_count);
  });
  m.def(
      "live_objects",
      [](py::tuple types) {
        // Per type, the objects the GC tracks, but tensors (types[0]) only C++ keeps alive (kept
        // in a list, one would outlive its TensorImpl).
        py::object objects = py::module_::import("gc").attr("get_objects")();
        std::vector<py::list> found(types.size());
        for (py::handle o : objects)
          for (size_t k = 0; k < types.size(); ++k) {
            if (!PyObject_TypeCheck(o.ptr(), reinterpret_cast<PyTypeObject*>(types[k].ptr())))
              continue;
            const uintptr_t impl = k == 0 ? ImplAddress(o.ptr()) : 1;
            if (impl != 0 && !(k == 0 && PyObjectOwnedByTensor(impl))) found[k].append(o);
            break;
          }
        return py::cast(found);
      },
      py::arg("types"));
}
