// torch_xla_donate._C: the native ledger and hot path, bound to Python.
// Folders mirror the Python package's roles:
//
//   base/      ledger (marks, records, per-step stats), ptr_index, py_types
//              (_C.Record, Entry, Verdict, Via), call_site, tensor_facts (c10
//              reads), tensor_access (torch_xla through bound callables)
//   marking/   marking's fast path (try_mark, try_mark_all, is_donatable)
//   outcomes/  poison (the native twin of poison.py), record_tag (the record
//              a poisoned TensorImpl carries), ownership (live objects)
//   hooks/     commit (a step's batch helpers), trampoline (_C.Trampoline)
//   auto/      dead_inputs (step inputs nothing else holds, found natively)
//   lazy/      lazy_reads (torch_xla's answers read through torch's lazy-tensor
//              headers), lazy_bindings (its lazy_* functions), live_tensors
//              (torch_xla's registry of live tensors, walked)
//
// This file binds the ledger and the record tags; each folder registers
// the rest itself.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "auto/dead_inputs.h"
#include "base/ledger.h"
#include "base/py_types.h"
#include "base/tensor_access.h"
#include "base/tensor_facts.h"
#include "base/variable.h"
#include "hooks/commit.h"
#include "hooks/trampoline.h"
#include "lazy/lazy_bindings.h"
#include "lazy/live_tensors.h"
#include "lazy/reaper.h"
#include "marking/marking.h"
#include "outcomes/donated_key.h"
#include "outcomes/ownership.h"
#include "outcomes/poison.h"
#include "outcomes/record_tag.h"

namespace py = pybind11;
using namespace torch_xla_donate;

namespace {

py::object RecordOrNone(RecordPtr r) {
  if (!r) return py::none();
  PyObject* o = WrapRecord(std::move(r));
  if (!o) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(o);
}

uintptr_t ImplOf(py::handle t) { return ImplAddress(t.ptr()); }

// Hands the hot path the torch / torch_xla / poison callables it needs.
void Bind(py::kwargs hooks) {
  static const std::pair<const char*, PyObject * Hooks::*> kSlots[] = {
      {"tensor_type", &Hooks::tensor_type},
      {"donated_type", &Hooks::donated_type},
      {"on_donated_dispatch", &Hooks::on_donated_dispatch},
  };
  for (auto item : hooks) {
    std::string name = py::str(item.first);
    bool known = false;
    for (const auto& slot : kSlots) {
      if (name != slot.first) continue;
      known = true;
      PyObject*& field = g_hooks.*(slot.second);
      PyObject* value = item.second.ptr();
      Py_INCREF(value);
      Py_XSETREF(field, value);
    }
    if (!known) throw py::type_error("bind(): unknown hook '" + name + "'");
  }
}

py::dict StatsToDict(const StepStats& s) {
  py::dict d;
  d["step"] = s.step;
  d["donated"] = s.donated;
  d["donated_bytes"] = s.donated_bytes;
  d["reused"] = s.reused;
  d["reused_bytes"] = s.reused_bytes;
  d["unused"] = s.unused;
  d["unused_bytes"] = s.unused_bytes;
  d["unused_shapes"] = s.unused_shapes;
  d["updated_in_place"] = s.updated_in_place;
  d["updated_in_place_bytes"] = s.updated_in_place_bytes;
  d["dropped"] = s.dropped;
  d["dropped_bytes"] = s.dropped_bytes;
  d["failed"] = s.failed;
  d["failed_bytes"] = s.failed_bytes;
  d["lost"] = s.lost;
  d["lost_bytes"] = s.lost_bytes;
  d["in_flight"] = s.in_flight;
  d["steps"] = s.steps;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native donation ledger and hot path of torch_xla_donate.";
  RegisterPyTypes(m.ptr());
  RegisterMarking(m.ptr());
  RegisterCommit(m.ptr());
  RegisterOwnership(m.ptr());
  RegisterTrampoline(m.ptr());
  RegisterLazyReads(m.ptr());
  RegisterLiveTensors(m.ptr());
  RegisterReaper(m.ptr());
  RegisterDonatedKey(m.ptr());
  RegisterDeadInputs(m.ptr());

  m.def(
      "mark",
      [](py::object tensor, std::string file, int line, std::vector<int64_t> shape,
         std::string dtype, int64_t nbytes, int via, int64_t version) -> py::object {
        // Garbage here would reach the next barrier (a None "tensor") or
        // corrupt the byte counts: refuse it where it comes in.
        if (tensor.is_none()) throw py::type_error("mark() needs a tensor, got None");
        if (nbytes < 0) throw py::value_error("mark(): nbytes must be >= 0");
        if (via < 0 || via >= kViaCount) throw py::value_error("mark(): no such via");
        for (int64_t d : shape)
          if (d < 0) throw py::value_error("mark(): shape sizes must be >= 0");
        RecordPtr record;
        GlobalLedger().Mark(std::move(tensor), std::make_shared<const std::string>(std::move(file)),
                            line, Dims(shape), InternDtype(dtype), nbytes, static_cast<Via>(via),
                            version, &record);
        return RecordOrNone(record);
      },
      py::arg("tensor"), py::arg("file"), py::arg("line"), py::arg("shape"), py::arg("dtype"),
      py::arg("nbytes"), py::arg("via") = 0, py::arg("version") = -1,
      "Marks a tensor for the next step; None if it is already marked.");
  m.def(
      "unmark",
      [](py::object tensor) -> py::object { return RecordOrNone(GlobalLedger().Unmark(tensor)); },
      py::arg("tensor"), "Removes a pending mark; returns its record or None.");
  m.def("is_marked", [](py::object t) { return GlobalLedger().IsMarked(t); }, py::arg("tensor"));
  m.def("marked_tensors", []() { return GlobalLedger().MarkedTensors(); });
  m.def("marked_count", []() { return GlobalLedger().MarkedCount(); });
  m.def(
      "begin_step",
      [](py::object only) {
        std::vector<PyObject*> keys;
        if (!only.is_none())
          for (auto t : only) keys.push_back(t.ptr());
        int64_t step;
        PyObject *tensors, *records;
        Check(BeginStepLists(only.is_none() ? nullptr : &keys, &step, &tensors, &records));
        return py::make_tuple(step, py::reinterpret_steal<py::list>(tensors),
                              py::reinterpret_steal<py::list>(records));
      },
      py::arg("only") = py::none(),
      "Commits the marks (all, or those of the tensors in `only`) to a new "
      "step: (step, tensors, records).");
  m.def(
      "settle",
      [](py::handle record, py::handle verdict) {
        const RecordPtr& r = RecordArg(record.ptr());
        if (!PyLong_Check(verdict.ptr())) throw py::type_error("settle() needs a Verdict");
        int v = py::cast<int>(verdict);
        if (v < 0 || v >= kVerdictCount) throw py::value_error("settle(): no such verdict");
        Verdict final_verdict = static_cast<Verdict>(v);
        if (final_verdict == Verdict::kMarked || final_verdict == Verdict::kInFlight)
          throw py::value_error("settle() needs a final verdict, got " +
                                std::string(VerdictName(final_verdict)));
        GlobalLedger().Settle(r, final_verdict);
      },
      py::arg("record"), py::arg("verdict"));
  m.def("current_step", []() { return GlobalLedger().current_step(); });
  m.def(
      "watch_deaths", [](py::handle cls) { return WatchDeaths(cls.ptr()); }, py::arg("cls"),
      "Lets an entry's weak hold on a poisoned tensor of class `cls` go as the tensor dies "
      "(poison.h WatchDeaths), after a __del__ it inherited; False if `cls` is no class.");
  m.def(
      "step_stats",
      [](int64_t step) -> py::object {
        StepStats s;
        if (!GlobalLedger().Stats(step, &s)) return py::none();
        return StatsToDict(s);
      },
      py::arg("step") = -1);
  m.def(
      "history",
      [](int64_t since) {
        py::list out;
        for (const auto& s : GlobalLedger().History(since)) out.append(StatsToDict(s));
        return out;
      },
      py::arg("since") = 0,
      "Stats of the steps numbered `since` or later among the last HISTORY_STEPS "
      "steps that committed donations, oldest first.");
  m.def(
      "generation", []() { return GlobalLedger().generation(); },
      "A number that changes whenever a step commits donations, a verdict is "
      "settled or the ledger is reset.");
  m.def("totals", []() { return StatsToDict(GlobalLedger().Totals()); });
  m.def("reset", []() { GlobalLedger().Reset(); });
  m.attr("HISTORY_STEPS") = Ledger::kHistorySteps;
#ifdef TDX_BUILT_FOR_TORCH
  m.attr("BUILT_FOR_TORCH") = TDX_BUILT_FOR_TORCH;
#else
  m.attr("BUILT_FOR_TORCH") = py::none();  // a build that did not say (Bazel)
#endif
  m.def("via_name", [](int via) {
    if (via < 0 || via >= kViaCount) throw py::value_error("no such via");
    return std::string(ViaName(static_cast<Via>(via)));
  });

  m.def("bind", &Bind,
        "Hands the hot path the torch / torch_xla / poison callables it needs "
        "(called by _base/xla.py and _outcomes/poison.py at import).");

  m.def(
      "poison",
      [](py::handle t, py::handle record, std::string note) {
        Check(Poison(t.ptr(), RecordArg(record.ptr()), note) == 0);
      },
      py::arg("tensor"), py::arg("record"), py::arg("note") = "",
      "Makes the tensor refuse every use (outcomes/poison.h); `note` says how a companion "
      "lost its buffer.");
  m.def(
      "unpoison", [](py::handle t) { Check(Unpoison(t.ptr()) == 0); }, py::arg("tensor"),
      "Gives a poisoned tensor back its class and dispatch keys.");
  // poison.py's and ownership.py's access to the TensorImpl (c10 headers).
  m.def(
      "tag_record",
      [](py::handle t, py::handle record, std::string note) {
        Check(TagTensor(t.ptr(), RecordArg(record.ptr()), note) == 0);
      },
      py::arg("tensor"), py::arg("record"), py::arg("note") = "",
      "Tags the tensor's TensorImpl with its donation record (and, for a tensor "
      "taken down with a donation, how).");
  m.def(
      "impl_address", [](py::handle t) { return ImplOf(t); }, py::arg("tensor"),
      "The address of the tensor's TensorImpl as the hot path reads it (t._cdata), 0 for "
      "anything else.");
  m.def(
      "tagged_note",
      [](py::handle t) -> std::string {
        uintptr_t impl = ImplOf(t);
        return impl ? TaggedNote(impl) : std::string();
      },
      py::arg("tensor"), "The note of the tensor's record tag, or ''.");
  m.def(
      "tagged_record",
      [](py::handle t) -> py::object {
        uintptr_t impl = ImplOf(t);
        return RecordOrNone(impl ? TaggedRecord(impl) : RecordPtr());
      },
      py::arg("tensor"), "The donation record the tensor is tagged with, or None.");
  m.def(
      "untag_record",
      [](py::handle t) {
        if (uintptr_t impl = ImplOf(t)) UntagRecord(impl);
      },
      py::arg("tensor"), "Removes the tensor's donation record tag, if any.");
  m.def(
      "storage_address",
      [](py::handle t) -> uintptr_t {
        uintptr_t impl = ImplOf(t);
        return impl ? StorageAddress(impl) : 0;
      },
      py::arg("tensor"), "The address of the tensor's StorageImpl (0: none, or not a tensor).");
  m.def(
      "use_counts",
      [](py::handle t) -> py::object {
        TensorFacts facts;
        int read = Facts(t.ptr(), &facts, /*with_sizes=*/false);
        Check(read >= 0);
        if (read == 0) return py::none();
        return py::make_tuple(facts.storage_use_count, facts.impl_use_count);
      },
      py::arg("tensor"), "(tensors sharing the storage, owners of the TensorImpl), or None.");
}
