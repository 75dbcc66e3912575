// torch_xla_donate._C: Python bindings of the donation ledger.
//
// Only the ledger lives here.  The calls into torch_xla go through
// torch_xla._XLAC from Python: its wheel exports no C++ symbols to link.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ledger.h"

namespace py = pybind11;
using namespace torch_xla_donate;

namespace {

py::dict StatsToDict(const StepStats& s) {
  py::dict d;
  d["step"] = s.step;
  d["donated"] = s.donated;
  d["donated_bytes"] = s.donated_bytes;
  d["consumed"] = s.consumed;
  d["consumed_bytes"] = s.consumed_bytes;
  d["unused"] = s.unused;
  d["unused_bytes"] = s.unused_bytes;
  d["unused_shapes"] = s.unused_shapes;
  d["updated_in_place"] = s.updated_in_place;
  d["failed"] = s.failed;
  d["pending"] = s.pending;
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "Native donation ledger of torch_xla_donate.";

  py::enum_<Verdict>(m, "Verdict")
      .value("MARKED", Verdict::kMarked)
      .value("IN_FLIGHT", Verdict::kInFlight)
      .value("CONSUMED", Verdict::kConsumed)
      .value("UNUSED", Verdict::kUnused)
      .value("UPDATED_IN_PLACE", Verdict::kUpdatedInPlace)
      .value("CANCELLED", Verdict::kCancelled)
      .value("STEP_FAILED", Verdict::kStepFailed)
      .value("DISABLED", Verdict::kDisabled);

  py::class_<Record, RecordPtr>(m, "Record")
      .def_readonly("id", &Record::id)
      .def_readonly("step", &Record::step)
      .def_readonly("file", &Record::file)
      .def_readonly("line", &Record::line)
      .def_property_readonly("shape", [](const Record& r) { return py::tuple(py::cast(r.shape)); })
      .def_readonly("dtype", &Record::dtype)
      .def_readonly("nbytes", &Record::nbytes)
      .def_readonly("verdict", &Record::verdict)
      .def_property_readonly("shape_string", &Record::ShapeString)
      .def_property_readonly("where", &Record::Where)
      .def("__repr__", [](const Record& r) {
        return "<donation #" + std::to_string(r.id) + " " + r.ShapeString() +
               " at " + r.Where() + " step=" + std::to_string(r.step) + " " +
               VerdictName(r.verdict) + ">";
      });

  m.def(
      "mark",
      [](py::object tensor, std::string file, int line, std::vector<int64_t> shape,
         std::string dtype, int64_t nbytes) -> py::object {
        RecordPtr r = GlobalLedger().Mark(std::move(tensor), std::move(file), line,
                                          std::move(shape), std::move(dtype), nbytes);
        if (!r) return py::none();
        return py::cast(r);
      },
      py::arg("tensor"), py::arg("file"), py::arg("line"), py::arg("shape"),
      py::arg("dtype"), py::arg("nbytes"),
      "Marks a tensor for the next step; None if it is already marked.");
  m.def(
      "unmark",
      [](py::object tensor) -> py::object {
        RecordPtr r = GlobalLedger().Unmark(tensor);
        if (!r) return py::none();
        return py::cast(r);
      },
      py::arg("tensor"), "Removes a pending mark; returns its record or None.");
  m.def("is_marked", [](py::object t) { return GlobalLedger().IsMarked(t); }, py::arg("tensor"));
  m.def("marked_tensors", []() { return GlobalLedger().MarkedTensors(); });
  m.def("marked_count", []() { return GlobalLedger().MarkedCount(); });
  m.def(
      "begin_step",
      []() {
        std::vector<py::object> tensors;
        std::vector<RecordPtr> records;
        int64_t step = GlobalLedger().BeginStep(&tensors, &records);
        py::list t(tensors.size()), r(records.size());
        for (size_t i = 0; i < tensors.size(); ++i) {
          t[i] = std::move(tensors[i]);
          r[i] = py::cast(records[i]);
        }
        return py::make_tuple(step, t, r);
      },
      "Commits all marks to a new step: (step, tensors, records).");
  m.def(
      "settle",
      [](const RecordPtr& r, Verdict v) {
        if (!r) throw py::type_error("settle() needs a Record");
        if (v == Verdict::kMarked || v == Verdict::kInFlight)
          throw py::value_error("settle() needs a final verdict, got " +
                                std::string(VerdictName(v)));
        GlobalLedger().Settle(r, v);
      },
      py::arg("record"), py::arg("verdict"));
  m.def("current_step", []() { return GlobalLedger().current_step(); });
  m.def(
      "step_stats",
      [](int64_t step) -> py::object {
        StepStats s;
        if (!GlobalLedger().Stats(step, &s)) return py::none();
        return StatsToDict(s);
      },
      py::arg("step") = -1);
  m.def("totals", []() { return StatsToDict(GlobalLedger().Totals()); });
  m.def("reset", []() { GlobalLedger().Reset(); });
  m.attr("HISTORY_STEPS") = Ledger::kHistorySteps;
}
