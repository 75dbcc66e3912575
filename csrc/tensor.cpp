// Torch tensors read natively (c10, torch's inline python_variable.h), and where a mark was made.
#include <Python.h>  // before frameobject.h

#include <ATen/FunctionalTensorWrapper.h>
#include <c10/core/ScalarType.h>
#include <c10/core/TensorImpl.h>
#include <dlfcn.h>
#include <frameobject.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cctype>
#include <type_traits>
#include <unordered_map>

#include "reads.h"

namespace torch_xla_donate {

Hooks g_hooks;

void RequireBound() {
  if (!g_hooks.tensor_type || !g_hooks.donated_type || !g_hooks.on_donated_dispatch)
    throw std::runtime_error("torch_xla_donate._C: hooks are not bound (import torch_xla_donate)");
}

namespace {

c10::TensorImpl* ImplAt(uintptr_t impl) { return reinterpret_cast<c10::TensorImpl*>(impl); }

// torch's THPVariable_Wrap from the libtorch_python torch loaded (not linked); null if not found.
using WrapFn = PyObject* (*)(const at::TensorBase&);
static_assert(std::is_same_v<WrapFn, decltype(&THPVariable_Wrap)>, "THPVariable_Wrap changed");
WrapFn TorchWrap() {
  static const WrapFn wrap = []() -> WrapFn {
    void* lib = dlopen("libtorch_python.so", RTLD_LAZY | RTLD_NOLOAD);
    if (lib == nullptr) return nullptr;
    void* symbol = dlsym(lib, "_Z16THPVariable_WrapRKN2at10TensorBaseE");
    dlclose(lib);  // drops RTLD_NOLOAD's reference only
    return reinterpret_cast<WrapFn>(symbol);
  }();
  return wrap;
}

}  // namespace

bool ReadTensorFacts(uintptr_t address, TensorFacts* out, bool with_sizes) {
  c10::TensorImpl* impl = ImplAt(address);
  try {
    // The key set, not impl->is_xla(), which a functional wrapper answers for its XLA tensor.
    out->is_xla = impl->key_set().has_backend(c10::BackendComponent::XLABit);
    out->is_functional = impl->key_set().has(c10::DispatchKey::Functionalize);
    const c10::Storage& storage = impl->unsafe_storage();
    out->storage_use_count = storage ? static_cast<long>(storage.use_count()) : 0;
    out->impl_use_count = static_cast<long>(c10::raw::intrusive_ptr::use_count(impl));
    out->has_autograd_meta = impl->autograd_meta() != nullptr;
    caffe2::TypeMeta dtype = impl->dtype();  // not const: torch 2.7's toScalarType()
    out->itemsize = static_cast<int64_t>(dtype.itemsize());
    out->scalar_type = dtype.isScalarType() ? static_cast<int>(dtype.toScalarType()) : -1;
    out->symbolic_sizes = impl->has_symbolic_sizes_strides();
    out->version =
        impl->is_inference() ? -1 : static_cast<int64_t>(impl->version_counter().current_version());
    out->sizes.clear();
    // The sizes the tensor reports, not a wrapper's fields (which miss a numel-keeping resize_).
    if (with_sizes && !out->symbolic_sizes) {
      c10::IntArrayRef sizes = impl->sizes();
      out->sizes.assign(sizes.begin(), sizes.end());
    }
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

bool IsTensor(PyObject* t) {
  return PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g_hooks.tensor_type));
}

bool IsDonatedType(PyObject* t) {
  return g_hooks.donated_type &&
         PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(g_hooks.donated_type));
}

uintptr_t ImplAddress(PyObject* t) {
  return IsTensor(t) ? reinterpret_cast<uintptr_t>(THPVariable_Unpack(t).unsafeGetTensorImpl()) : 0;
}

int Facts(PyObject* t, TensorFacts* facts, bool with_sizes) {
  const uintptr_t impl = ImplAddress(t);
  return impl != 0 && ReadTensorFacts(impl, facts, with_sizes) ? 1 : 0;
}

bool HasPythonDispatch(uintptr_t impl) {
  return ImplAt(impl)->key_set().has(c10::DispatchKey::Python);
}

bool IsView(PyObject* t) { return THPVariable_Unpack(t).is_view(); }

bool HeldByAutograd(PyObject* t, const TensorFacts& facts) {
  if (facts.impl_use_count <= 1) return false;
  const at::Tensor& v = THPVariable_Unpack(t);
  const bool accumulates = v.is_leaf() && v.requires_grad();  // its AccumulateGrad holds it
  return facts.impl_use_count > 1 + (accumulates ? 1 : 0);
}

bool OnlyHeldByItsEntry(PyObject* t) {
  // A finalizer (a subclass's __del__) may bring the object back.
  if (Py_REFCNT(t) != 1 || Py_TYPE(t)->tp_finalize || Py_TYPE(t)->tp_del) return false;
#if PY_VERSION_HEX < 0x030C0000
  if (Py_TYPE(t)->tp_weaklistoffset > 0 && *PyObject_GET_WEAKREFS_LISTPTR(t) != nullptr)
    return false;
#else
  return false;  // weak references are the interpreter's: assume some
#endif
  TensorFacts facts;
  return Facts(t, &facts, false) == 1 && facts.impl_use_count == 1;
}

uintptr_t StorageAddress(uintptr_t impl) {
  const c10::Storage& storage = ImplAt(impl)->unsafe_storage();
  return storage ? reinterpret_cast<uintptr_t>(storage.unsafeGetStorageImpl()) : 0;
}

uintptr_t FunctionalInnerImpl(PyObject* t) {
  const at::Tensor& outer = THPVariable_Unpack(t);
  if (!at::functionalization::impl::isFunctionalTensor(outer)) return 0;
  return reinterpret_cast<uintptr_t>(at::functionalization::impl::unsafeGetFunctionalWrapper(outer)
                                         ->value()
                                         .unsafeGetTensorImpl());
}

bool PyObjectOwnedByTensor(uintptr_t impl) { return ImplAt(impl)->pyobj_slot()->owns_pyobj(); }

PyObject* WrapTensorImpl(uintptr_t impl) {
  const WrapFn wrap = TorchWrap();
  if (wrap == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "torch's THPVariable_Wrap was not found");
    return nullptr;
  }
  c10::raw::intrusive_ptr::incref(ImplAt(impl));
  const at::Tensor tensor(
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(ImplAt(impl)));
  return wrap(tensor);
}

uintptr_t WeakTensorTake(PyObject* t) {
  if (TorchWrap() == nullptr) return 0;
  c10::TensorImpl* impl = THPVariable_Unpack(t).unsafeGetTensorImpl();
  c10::raw::weak_intrusive_ptr::incref(impl);
  return reinterpret_cast<uintptr_t>(impl);
}

void WeakTensorDrop(uintptr_t impl) { c10::raw::weak_intrusive_ptr::decref(ImplAt(impl)); }

bool WeakTensorAlive(uintptr_t impl) {
  // The TensorImpl keeps its Python object's address while that lives.
  return c10::raw::weak_intrusive_ptr::use_count(ImplAt(impl)) > 0 &&
         ImplAt(impl)->pyobj_slot()->_unchecked_untagged_pyobj() != nullptr;
}

PyObject* WeakTensorObject(uintptr_t impl) {
  c10::TensorImpl* locked = c10::raw::weak_intrusive_ptr::lock(ImplAt(impl));
  if (locked == nullptr) return nullptr;
  const at::Tensor tensor(
      c10::intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>::reclaim(locked));
  if (locked->pyobj_slot()->_unchecked_untagged_pyobj() == nullptr) return nullptr;
  return TorchWrap()(tensor);  // the object the TensorImpl keeps, given back to Python
}

DtypeName DtypeNameOf(int scalar_type) {
  static std::unordered_map<int, DtypeName> names;
  auto it = names.find(scalar_type);
  if (it != names.end()) return it->second;
  using S = c10::ScalarType;
  static const std::pair<S, const char*> kXla[] = {
      {S::Float, "f32"},  {S::Double, "f64"}, {S::Half, "f16"},         {S::BFloat16, "bf16"},
      {S::Char, "s8"},    {S::Short, "s16"},  {S::Int, "s32"},          {S::Long, "s64"},
      {S::Byte, "u8"},    {S::Bool, "pred"},  {S::ComplexFloat, "c64"}, {S::ComplexDouble, "c128"},
      {S::UInt16, "u16"}, {S::UInt32, "u32"}, {S::UInt64, "u64"},
  };
  const auto st = static_cast<S>(scalar_type);
  std::string name = scalar_type < 0 ? "?" : c10::toString(st);
  for (char& ch : name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (const auto& [s, n] : kXla)
    if (s == st) name = n;
  return names.emplace(scalar_type, InternDtype(name)).first->second;
}

// -- Where: line numbers cached per (code, instruction), keys held against address reuse; bounded.
namespace {

constexpr size_t kMaxCodes = 4096, kMaxLinesPerCode = 256;
struct CodeInfo {
  FilePtr file;
  std::unordered_map<int, int> lines;  // instruction offset -> line
};
std::unordered_map<PyObject*, CodeInfo> g_codes;
std::unordered_map<PyObject*, FilePtr> g_file_names;  // `where` tuples' str objects

FilePtr NewFile(PyObject* name) {
  const char* s = name ? PyUnicode_AsUTF8(name) : nullptr;
  return s ? std::make_shared<const std::string>(s) : nullptr;
}

bool FrameWhere(PyFrameObject* frame, FilePtr* file, int* line) {
  PyCodeObject* code = PyFrame_GetCode(frame);
  auto it = g_codes.find(reinterpret_cast<PyObject*>(code));
  if (it == g_codes.end()) {
    FilePtr f = NewFile(code->co_filename);
    if (!f || g_codes.size() >= kMaxCodes) {
      Py_DECREF(code);
      *file = std::move(f);
      *line = PyFrame_GetLineNumber(frame);
      return *file != nullptr;
    }
    it = g_codes.emplace(Py_NewRef(code), CodeInfo{std::move(f), {}}).first;  // the cache's
  }
  Py_DECREF(code);
  CodeInfo& info = it->second;
  *file = info.file;
  const int lasti = PyFrame_GetLasti(frame);
  auto l = info.lines.find(lasti);
  if (l != info.lines.end()) {
    *line = l->second;
    return true;
  }
  *line = PyFrame_GetLineNumber(frame);
  if (info.lines.size() < kMaxLinesPerCode) info.lines.emplace(lasti, *line);
  return true;
}

}  // namespace

bool ResolveWhere(PyObject* where, FilePtr* file, int* line) {
  if (PyLong_Check(where)) {
    long depth = PyLong_AsLong(where);
    PyFrameObject* frame = PyEval_GetFrame();  // borrowed
    Py_XINCREF(frame);
    for (long i = 0; i < depth && frame; ++i) {
      PyFrameObject* back = PyFrame_GetBack(frame);
      Py_DECREF(frame);
      frame = back;
    }
    if (!frame) {
      static const FilePtr kUnknown = std::make_shared<const std::string>("<unknown>");
      *file = kUnknown;
      *line = 0;
      return true;
    }
    const bool ok = FrameWhere(frame, file, line);
    Py_DECREF(frame);
    return ok;
  }
  if (!PyTuple_Check(where) || PyTuple_GET_SIZE(where) != 2 ||
      !PyUnicode_Check(PyTuple_GET_ITEM(where, 0))) {
    PyErr_SetString(PyExc_TypeError, "where must be (file, line) or a frame depth");
    return false;
  }
  const long l = PyLong_AsLong(PyTuple_GET_ITEM(where, 1));
  if (l == -1 && PyErr_Occurred()) return false;
  *line = static_cast<int>(l);
  PyObject* name = PyTuple_GET_ITEM(where, 0);
  auto it = g_file_names.find(name);
  if (it != g_file_names.end()) {
    *file = it->second;
    return true;
  }
  *file = NewFile(name);
  if (*file && g_file_names.size() < kMaxCodes) g_file_names.emplace(Py_NewRef(name), *file);
  return *file != nullptr;
}

}  // namespace torch_xla_donate
