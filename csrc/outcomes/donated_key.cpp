// See donated_key.h.
#include "outcomes/donated_key.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/core/TensorImpl.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/library.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "base/tensor_access.h"
#include "base/variable.h"
#include "outcomes/record_tag.h"

namespace py = pybind11;

namespace torch_xla_donate {
namespace {

constexpr c10::DispatchKey kDonatedKey = c10::DispatchKey::TESTING_ONLY_GenericWrapper;

// The key set of a TensorImpl: protected in c10::TensorImpl, and changed
// only as TensorImpl's own setters change it (one functionality bit).
struct KeySetAccess : c10::TensorImpl {
  static c10::DispatchKeySet& Of(c10::TensorImpl* impl) {
    return static_cast<KeySetAccess*>(impl)->key_set_;
  }
};

c10::TensorImpl* ImplAt(uintptr_t impl) { return reinterpret_cast<c10::TensorImpl*>(impl); }

std::atomic<bool> g_in_use{false};
const Record* g_probe = nullptr;  // SelfTestDonatedKey's record, while it runs

struct ProbeRefused {};  // the self-test's operator reached the fallback

// A tensor argument is donated when it has the key and a record tag; a
// shallow copy (detach, .data) inherits the key set but not the tag.
bool Donated(const at::Tensor& t) {
  return t.defined() && t.key_set().has(kDonatedKey) &&
         TaggedRecord(reinterpret_cast<uintptr_t>(t.unsafeGetTensorImpl())) != nullptr;
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

// copy_ and functionalization's copy overwrite every element of their first
// argument and read none: a consumed tensor may be refilled by them, when
// it is that argument and no other (poison.py's _REFILLS).
bool RefillsFirst(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                  const std::vector<at::Tensor>& donated) {
  const std::string& name = op.schema().name();
  if (name != "aten::copy_" && name != "aten::copy") return false;
  if (args.empty() || !args[0].isTensor()) return false;
  const c10::TensorImpl* first = args[0].toTensor().unsafeGetTensorImpl();
  int seen = 0;
  for (const at::Tensor& t : donated) seen += t.unsafeGetTensorImpl() == first;
  return seen == 1 && donated[0].unsafeGetTensorImpl() == first;
}

// Asks poison.py about the donated arguments (the GIL taken here: the
// dispatcher may run without it, on any thread); a Python error comes back
// as torch's own python_error, which torch's bindings turn back into it.
void AskPython(const std::vector<at::Tensor>& donated, bool refill_first) {
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* tensors = PyList_New(static_cast<Py_ssize_t>(donated.size()));
  bool ok = tensors != nullptr;
  for (size_t i = 0; ok && i < donated.size(); ++i) {
    PyObject* obj = WrapTensor(donated[i]);
    ok = obj != nullptr;
    if (ok) PyList_SET_ITEM(tensors, static_cast<Py_ssize_t>(i), obj);
  }
  PyObject* result = nullptr;
  if (ok && g_hooks.on_donated_dispatch != nullptr) {
    result = PyObject_CallFunctionObjArgs(g_hooks.on_donated_dispatch, tensors,
                                          refill_first ? Py_True : Py_False, nullptr);
  } else if (ok) {
    PyErr_SetString(PyExc_RuntimeError,
                    "torch_xla_donate: a donated tensor was used before "
                    "the package bound its poisoning");
  }
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
  const size_t n = op.schema().arguments().size();
  // _propagate_xla_data moves an alias id after an in-place update: metadata
  // only, no value read (poison.py's _PROPAGATE_XLA_DATA).
  if (op.schema().name() != "aten::_propagate_xla_data") {
    c10::ArrayRef<c10::IValue> args = torch::jit::last(*stack, n);
    std::vector<at::Tensor> donated;
    for (const c10::IValue& v : args) CollectDonated(v, &donated);
    if (!donated.empty()) {
      if (g_probe != nullptr &&
          TaggedRecord(reinterpret_cast<uintptr_t>(donated[0].unsafeGetTensorImpl())).get() ==
              g_probe)
        throw ProbeRefused{};
      AskPython(donated, RefillsFirst(op, args, donated));
    }
  }
  op.redispatchBoxed(keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kDonatedKey),
                     stack);
}

// Registers the fallback unless the key has one: "" or why not.
std::string RegisterFallback() {
  static std::once_flag once;
  static std::string why;
  static std::unique_ptr<torch::Library> library;
  std::call_once(once, []() {
    try {
      if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(kDonatedKey)) {
        why = "its dispatch key already has a fallback";
        return;
      }
      library = std::make_unique<torch::Library>(torch::Library::IMPL, "_", kDonatedKey, __FILE__,
                                                 __LINE__);
      library->fallback(torch::CppFunction::makeFromBoxedFunction<&Fallback>());
    } catch (const std::exception& e) {
      why = std::string("registering its fallback failed: ") + e.what();
    }
  });
  return why;
}

}  // namespace

bool DonatedKeyInUse() { return g_in_use.load(std::memory_order_relaxed); }

void SetDonatedKey(uintptr_t impl, bool on) {
  c10::DispatchKeySet& keys = KeySetAccess::Of(ImplAt(impl));
  keys = on ? keys.add(kDonatedKey) : keys.remove(kDonatedKey);
}

bool HasDonatedKey(uintptr_t impl) { return ImplAt(impl)->key_set().has(kDonatedKey); }

std::string SelfTestDonatedKey(PyObject* probe) {
  if (!IsTensor(probe)) return "the probe is no tensor";
  std::string why = RegisterFallback();
  if (!why.empty()) return why;
  const at::Tensor& outer = THPVariable_Unpack(probe);
  uintptr_t impl = FunctionalInnerImpl(probe);  // the TensorImpl poisoning keys
  if (impl == 0) impl = ImplAddress(probe);
  auto record = std::make_shared<Record>();
  if (!TagRecord(impl, record)) return "the probe could not be tagged";
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
  if (!refused) {
    return "an operator on the probe was not refused" +
           (error.empty() ? std::string() : ": " + error);
  }
  try {
    (void)outer.mul(2);
  } catch (const std::exception& e) {
    return std::string("the probe, its key removed, was still refused: ") + e.what();
  }
  if (HasDonatedKey(impl)) return "the key could not be removed";
  g_in_use.store(true, std::memory_order_relaxed);
  return "";
}

void RegisterDonatedKey(PyObject* module) {
  py::module_ m = py::reinterpret_borrow<py::module_>(module);
  m.def(
      "donated_key_self_test", [](py::handle probe) { return SelfTestDonatedKey(probe.ptr()); },
      py::arg("probe"),
      "Tries the donated key on `probe` (a CPU tensor): '' and poisoning uses it, or why not.");
  m.def("donated_key_in_use", &DonatedKeyInUse);
  m.def(
      "set_donated_key",
      [](py::handle t, bool on) {
        uintptr_t impl = ImplAddress(t.ptr());
        if (!impl) throw py::type_error("set_donated_key() needs a torch.Tensor");
        SetDonatedKey(impl, on);
      },
      py::arg("tensor"), py::arg("on"));
  m.def(
      "functional_inner_has_object",
      [](py::handle t) { return IsTensor(t.ptr()) && FunctionalInnerHasObject(t.ptr()); },
      py::arg("tensor"),
      "Tests: whether the tensor a functional tensor wraps has a Python object.");
  m.def(
      "has_donated_key",
      [](py::handle t) {
        uintptr_t impl = ImplAddress(t.ptr());
        return impl != 0 && HasDonatedKey(impl);
      },
      py::arg("tensor"));
}

}  // namespace torch_xla_donate
