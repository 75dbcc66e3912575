// Poisoning: a dispatch key (whose fallback refuses every operator) and a record tag on the tensor
// torch_xla computes with, a twin class on the user's (docs/design.md, "A dispatch key for
// poison").
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/TensorImpl.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <unordered_map>
#include <unordered_set>

#include "reads.h"

namespace torch_xla_donate {
namespace {

constexpr c10::DispatchKey kDonatedKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

c10::TensorImpl* ImplAt(uintptr_t impl) { return reinterpret_cast<c10::TensorImpl*>(impl); }

// The key set is protected in c10::TensorImpl; changed as its setters do.
struct KeySetAccess : c10::TensorImpl {
  static c10::DispatchKeySet& Of(c10::TensorImpl* impl) {
    return static_cast<KeySetAccess*>(impl)->key_set_;
  }
};

void SetDonatedKey(uintptr_t impl, bool on) {
  c10::DispatchKeySet& keys = KeySetAccess::Of(ImplAt(impl));
  keys = on ? keys.add(kDonatedKey) : keys.remove(kDonatedKey);
}

// -- The record tag: a BackendMeta freed with the impl; shallow copies (detach, .data) lack it.
class RecordTag final : public c10::BackendMeta {
 public:
  RecordTag(RecordPtr record, std::string note, c10::intrusive_ptr<c10::BackendMeta> replaced)
      : record(std::move(record)), note(std::move(note)), replaced(std::move(replaced)) {}
  c10::intrusive_ptr<c10::BackendMeta> clone(
      const c10::intrusive_ptr<c10::BackendMeta>&) const override {
    return replaced ? replaced->clone(replaced) : c10::intrusive_ptr<c10::BackendMeta>();
  }
  RecordPtr record;
  std::string note;  // how a tensor that was not marked lost its buffer with it
  c10::intrusive_ptr<c10::BackendMeta> replaced;
};

RecordTag* TagOf(uintptr_t impl) {
  return dynamic_cast<RecordTag*>(ImplAt(impl)->get_backend_meta());
}
RecordTag* TagOfObject(PyObject* t) {
  const uintptr_t impl = ImplAddress(t);
  return impl ? TagOf(impl) : nullptr;
}

bool TagRecord(uintptr_t impl, RecordPtr record, std::string note) {
  try {
    RecordTag* old = TagOf(impl);
    auto replaced = old ? old->replaced : ImplAt(impl)->get_backend_meta_intrusive_ptr();
    ImplAt(impl)->set_backend_meta(
        c10::make_intrusive<RecordTag>(std::move(record), std::move(note), std::move(replaced)));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void UntagRecord(uintptr_t impl) {
  if (RecordTag* tag = TagOf(impl)) ImplAt(impl)->set_backend_meta(tag->replaced);
}

// -- The fallback
std::atomic<bool> g_key_in_use{false};
const Record* g_probe = nullptr;  // the self-test's record, while it runs
struct ProbeRefused {};

// Donated: the key and a tag (a shallow copy inherits the key, not the tag).
bool Donated(const at::Tensor& t) {
  return t.defined() && t.key_set().has(kDonatedKey) &&
         TagOf(reinterpret_cast<uintptr_t>(t.unsafeGetTensorImpl())) != nullptr;
}

void CollectDonated(const c10::IValue& v, std::vector<at::Tensor>* out) {
  if (v.isTensor()) {
    if (Donated(v.toTensor())) out->push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList().vec())
      if (Donated(t)) out->push_back(t);
  } else if (v.isOptionalTensorList()) {
    for (const std::optional<at::Tensor>& t : v.toOptionalTensorList().vec())
      if (t.has_value() && Donated(*t)) out->push_back(*t);
  } else if (v.isList()) {
    for (const c10::IValue& item : v.toListRef()) CollectDonated(item, out);
  }
}

// copy_ overwrites its first argument unread: a consumed tensor may be refilled as that alone.
bool RefillsFirst(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                  const std::vector<at::Tensor>& donated) {
  const std::string& name = op.schema().name();
  if ((name != "aten::copy_" && name != "aten::copy") || args.empty() || !args[0].isTensor())
    return false;
  const c10::TensorImpl* first = args[0].toTensor().unsafeGetTensorImpl();
  int seen = 0;
  for (const at::Tensor& t : donated) seen += t.unsafeGetTensorImpl() == first;
  return seen == 1 && donated[0].unsafeGetTensorImpl() == first;
}

// _poison.on_donated_dispatch decides; a Python error goes back as torch's python_error.
void AskPython(const std::vector<at::Tensor>& donated, bool refill_first) {
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* tensors = PyList_New(static_cast<Py_ssize_t>(donated.size()));
  bool ok = tensors != nullptr;
  for (size_t i = 0; ok && i < donated.size(); ++i) {
    PyObject* obj = WrapTensorImpl(reinterpret_cast<uintptr_t>(donated[i].unsafeGetTensorImpl()));
    ok = obj != nullptr;
    if (ok) PyList_SET_ITEM(tensors, static_cast<Py_ssize_t>(i), obj);
  }
  PyObject* result = nullptr;
  if (ok && g_hooks.on_donated_dispatch)
    result = PyObject_CallFunctionObjArgs(g_hooks.on_donated_dispatch, tensors,
                                          refill_first ? Py_True : Py_False, nullptr);
  else if (ok)
    PyErr_SetString(PyExc_RuntimeError, "torch_xla_donate: poisoning is not bound");
  Py_XDECREF(tensors);
  if (result == nullptr) {
    python_error error;
    error.persist();
    PyGILState_Release(gil);
    throw std::move(error);
  }
  Py_DECREF(result);
  PyGILState_Release(gil);
}

void Fallback(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  // _propagate_xla_data moves metadata only after an in-place update.
  if (op.schema().name() != "aten::_propagate_xla_data") {
    c10::ArrayRef<c10::IValue> args = torch::jit::last(*stack, op.schema().arguments().size());
    std::vector<at::Tensor> donated;
    for (const c10::IValue& v : args) CollectDonated(v, &donated);
    if (!donated.empty()) {
      if (g_probe &&
          TagOf(reinterpret_cast<uintptr_t>(donated[0].unsafeGetTensorImpl()))->record.get() ==
              g_probe)
        throw ProbeRefused{};
      AskPython(donated, RefillsFirst(op, args, donated));
    }
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kDonatedKey),
                     stack);
}

std::string RegisterFallback() {  // once, unless the key has a fallback: "" or why not
  static std::once_flag once;
  static std::string why;
  static torch::Library* library = nullptr;  // leaked: lives as long as the process
  std::call_once(once, []() {
    try {
      if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kDonatedKey)) {
        why = "its dispatch key already has a fallback";
        return;
      }
      library = new torch::Library(torch::Library::IMPL, "_", kDonatedKey, __FILE__, __LINE__);
      library->fallback(torch::CppFunction::makeFromBoxedFunction<&Fallback>());
    } catch (const std::exception& e) {
      why = std::string("registering its fallback failed: ") + e.what();
    }
  });
  return why;
}

// A tensor refused with the key, served without it: "" and the key in use.
std::string SelfTest(PyObject* probe) {
  if (!IsTensor(probe)) return "the probe is no tensor";
  std::string why = RegisterFallback();
  if (!why.empty()) return why;
  const at::Tensor& outer = THPVariable_Unpack(probe);
  uintptr_t impl = FunctionalInnerImpl(probe);
  if (impl == 0) impl = ImplAddress(probe);
  RecordPtr record = NewRecord();
  if (!TagRecord(impl, record, "")) return "the probe could not be tagged";
  bool refused = false;
  std::string error;
  g_probe = record.get();
  SetDonatedKey(impl, true);
  try {
    (void)outer.mul(2);
  } catch (const ProbeRefused&) {
    refused = true;
  } catch (const std::exception& e) {
    error = e.what();
  }
  SetDonatedKey(impl, false);
  UntagRecord(impl);
  g_probe = nullptr;
  if (!refused)
    return "an operator on the probe was not refused" + (error.empty() ? "" : ": " + error);
  try {
    (void)outer.mul(2);
  } catch (const std::exception& e) {
    return std::string("the probe, its key removed, was still refused: ") + e.what();
  }
  g_key_in_use.store(true);
  return "";
}

// -- The twin classes
std::unordered_map<PyTypeObject*, PyObject*> g_twins;  // class -> its poisoned twin
std::unordered_set<PyObject*> g_checked;  // twins Python's __class__ assignment accepted once

PyObject* ClassAttr() {
  static PyObject* name = PyUnicode_InternFromString("__class__");
  return name;
}

// `t.__class__ = twin`: once per twin with Python's checks, then what object_set_class does after
// them (the twin adds nothing to the layout).
int SwapClass(PyObject* t, PyObject* twin) {
  PyTypeObject* from = Py_TYPE(t);
  auto* to = reinterpret_cast<PyTypeObject*>(twin);
  const bool managed = (from->tp_flags | to->tp_flags) & Py_TPFLAGS_MANAGED_DICT;
  if (!g_checked.count(twin) || (managed && _PyObject_GetDictPtr(t) == nullptr)) {
    if (PyObject_GenericSetAttr(t, ClassAttr(), twin) < 0) return -1;
    g_checked.insert(twin);
    return 0;
  }
  if (PySys_Audit("object.__setattr__", "OsO", t, "__class__", twin) < 0) return -1;
  if (to->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_INCREF(to);
  Py_SET_TYPE(t, to);
  if (from->tp_flags & Py_TPFLAGS_HEAPTYPE) Py_DECREF(from);
  return 0;
}

// The TensorImpl torch_xla computes with behind `t` (a functional wrapper's value); 0 for none.
uintptr_t CoreImpl(PyObject* t, uintptr_t impl) {
  return impl && ImplAt(impl)->key_set().has(c10::DispatchKey::Functionalize)
             ? FunctionalInnerImpl(t)
             : impl;
}

// A poisoned tensor's Python object is dying: its entry's weak reference goes, so its TensorImpl
// and XLATensor die with it.  A TensorImpl whose destructor frees the object (no strong reference
// left) has no weak one either, so no entry: it is not read, being half destroyed.
std::unordered_map<PyTypeObject*, destructor> g_user_finalizers;  // a twin's inherited __del__
void TwinFinalize(PyObject* self) {
  auto it = g_user_finalizers.find(Py_TYPE(self));
  if (it != g_user_finalizers.end()) it->second(self);
  const uintptr_t impl = ImplAddress(self);
  if (impl == 0 || c10::raw::intrusive_ptr::use_count(ImplAt(impl)) == 0) return;
  const uintptr_t core = CoreImpl(self, impl);
  if (RecordTag* tag = core ? TagOf(core) : nullptr) WeakenedTensorDying(impl, tag->record.get());
}

uintptr_t CoreOf(PyObject* t) {
  const uintptr_t core = CoreImpl(t, ImplAddress(t));
  if (core == 0) PyErr_SetString(PyExc_TypeError, "expected a readable torch.Tensor");
  return core;
}

int Unpoison(PyObject* t) {
  const uintptr_t core = CoreOf(t);
  if (core == 0) return -1;
  SetDonatedKey(core, false);
  UntagRecord(core);
  if (!IsDonatedType(t)) return 0;
  PyObject* bases = Py_TYPE(t)->tp_bases;  // (mixin, the class it was made for)
  PyObject* original = PyTuple_GET_ITEM(bases, PyTuple_GET_SIZE(bases) - 1);
  if (TwinClassOf(reinterpret_cast<PyTypeObject*>(original)) != (PyObject*)Py_TYPE(t)) {
    PyErr_SetString(PyExc_TypeError, "a donated class torch_xla_donate did not make");
    return -1;
  }
  return PyObject_GenericSetAttr(t, ClassAttr(), original);
}

}  // namespace

PyObject* TwinClassOf(PyTypeObject* type) {
  auto it = g_twins.find(type);
  return it == g_twins.end() ? nullptr : it->second;
}

int Poison(PyObject* t, const RecordPtr& record, const std::string& note) {
  // The core first: once it refuses operators, the value is safe whatever befalls the wrapper.
  if (!g_key_in_use.load()) {
    PyErr_SetString(PyExc_RuntimeError, "poisoning's dispatch key is off");
    return -1;
  }
  const uintptr_t core = CoreOf(t);
  if (core == 0) return -1;
  if (!TagRecord(core, record, note)) {
    PyErr_SetString(PyExc_TypeError, "cannot tag this tensor with its donation record");
    return -1;
  }
  SetDonatedKey(core, true);
  if (IsDonatedType(t)) return 0;
  PyObject* twin = TwinClassOf(Py_TYPE(t));
  if (twin == nullptr) {
    PyErr_Format(PyExc_TypeError, "no poisoned twin of %s was registered", Py_TYPE(t)->tp_name);
    return -1;
  }
  return SwapClass(t, twin);
}

void RegisterPoison(py::module_& m) {
  m.def(
      "donated_key_self_test", [](py::handle probe) { return SelfTest(probe.ptr()); },
      py::arg("probe"), "Tries the donated key on `probe`: '' and poisoning uses it, or why not.");
  m.def("has_donated_key", [](py::handle t) {
    const uintptr_t impl = ImplAddress(t.ptr());
    return impl != 0 && ImplAt(impl)->key_set().has(kDonatedKey);
  });
  m.def(
      "poison",
      [](py::handle t, py::handle record, std::string note) {
        Check(Poison(t.ptr(), RecordArg(record.ptr()), note) == 0);
      },
      py::arg("tensor"), py::arg("record"), py::arg("note") = "",
      "Makes the tensor refuse every use; `note` says how a companion lost its buffer.");
  m.def("unpoison", [](py::handle t) { Check(Unpoison(t.ptr()) == 0); }, py::arg("tensor"));
  m.def(
      "tag_record",
      [](py::handle t, py::handle record, std::string note) {
        const uintptr_t impl = ImplAddress(t.ptr());
        if (impl == 0) throw py::type_error("expected a torch.Tensor");
        if (!TagRecord(impl, RecordArg(record.ptr()), note))
          throw py::type_error("cannot tag this tensor with its donation record");
      },
      py::arg("tensor"), py::arg("record"), py::arg("note") = "");
  m.def("untag_record", [](py::handle t) {
    if (const uintptr_t impl = ImplAddress(t.ptr())) UntagRecord(impl);
  });
  m.def("tagged_record", [](py::handle t) -> py::object {
    RecordTag* tag = TagOfObject(t.ptr());
    return tag ? py::reinterpret_steal<py::object>(WrapRecord(tag->record)) : py::none();
  });
  m.def("tagged_note", [](py::handle t) -> std::string {
    RecordTag* tag = TagOfObject(t.ptr());
    return tag ? tag->note : "";
  });
  m.def(
      "register_twin",
      [](py::handle cls, py::handle twin) {
        if (!PyType_Check(cls.ptr()) || !PyType_Check(twin.ptr()))
          throw py::type_error("register_twin(cls, twin) takes two classes");
        auto* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
        if (g_twins.count(type)) return;
        g_twins.emplace(type, twin.inc_ref().ptr());
        cls.inc_ref();  // a key's address must not be reused
        auto* twin_type = reinterpret_cast<PyTypeObject*>(twin.ptr());
        if (twin_type->tp_finalize) g_user_finalizers.emplace(twin_type, twin_type->tp_finalize);
        twin_type->tp_finalize = TwinFinalize;
      },
      py::arg("cls"), py::arg("twin"),
      "Tensors of `cls` may be marked: poisoning gives them `twin`.");
  m.def(
      "twin_of",
      [](py::handle cls) -> py::object {
        if (!PyType_Check(cls.ptr())) return py::none();
        PyObject* twin = TwinClassOf(reinterpret_cast<PyTypeObject*>(cls.ptr()));
        return twin ? py::reinterpret_borrow<py::object>(twin) : py::none();
      },
      py::arg("cls"));
}

}  // namespace torch_xla_donate
