// See call_site.h.
#include "base/call_site.h"

#include <frameobject.h>

#include <memory>
#include <string>
#include <unordered_map>

namespace torch_xla_donate {
namespace {

constexpr size_t kMaxCachedCodes = 4096;
constexpr size_t kMaxCachedLinesPerCode = 256;

struct CodeInfo {
  FilePtr file;
  std::unordered_map<int, int> lines;  // instruction offset -> line
};
std::unordered_map<PyObject*, CodeInfo> g_codes;
// File names given as str (the `where` tuples of helpers), by str object.
std::unordered_map<PyObject*, FilePtr> g_file_names;

FilePtr NewFile(PyObject* name) {
  const char* s = PyUnicode_AsUTF8(name);
  return s ? std::make_shared<const std::string>(s) : nullptr;
}

FilePtr CodeFile(PyObject* code) {
  PyObject* name = PyObject_GetAttrString(code, "co_filename");
  if (!name) return nullptr;
  FilePtr file = NewFile(name);
  Py_DECREF(name);
  return file;
}

// The last answer, for a loop that marks tensor after tensor from one line:
// a code object the cache holds (so its address names it) and an offset.
struct LastHit {
  PyObject* code = nullptr;
  int lasti = -1;
  FilePtr file;
  int line = 0;
};
LastHit g_last;

// File and line of `frame`, through the caches.  False with a Python error.
bool FrameWhere(PyFrameObject* frame, FilePtr* file, int* line) {
  PyObject* code = reinterpret_cast<PyObject*>(PyFrame_GetCode(frame));  // new ref
  if (code == g_last.code && PyFrame_GetLasti(frame) == g_last.lasti) {
    Py_DECREF(code);
    *file = g_last.file;
    *line = g_last.line;
    return true;
  }
  auto it = g_codes.find(code);
  if (it == g_codes.end()) {
    FilePtr f = CodeFile(code);
    if (!f || g_codes.size() >= kMaxCachedCodes) {
      Py_DECREF(code);
      *file = std::move(f);
      *line = PyFrame_GetLineNumber(frame);
      return *file != nullptr;
    }
    Py_INCREF(code);  // held by the cache
    it = g_codes.emplace(code, CodeInfo{std::move(f), {}}).first;
  }
  Py_DECREF(code);
  CodeInfo& info = it->second;
  *file = info.file;
  const int lasti = PyFrame_GetLasti(frame);
  auto l = info.lines.find(lasti);
  if (l != info.lines.end()) {
    *line = l->second;
  } else {
    *line = PyFrame_GetLineNumber(frame);
    if (info.lines.size() < kMaxCachedLinesPerCode) info.lines.emplace(lasti, *line);
  }
  g_last = LastHit{it->first, lasti, *file, *line};
  return true;
}

}  // namespace

FilePtr FileNamed(PyObject* name) {
  auto it = g_file_names.find(name);
  if (it != g_file_names.end()) return it->second;
  FilePtr file = NewFile(name);
  if (file && g_file_names.size() < kMaxCachedCodes) {
    Py_INCREF(name);  // held by the cache
    g_file_names.emplace(name, file);
  }
  return file;
}

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
    bool ok = FrameWhere(frame, file, line);
    Py_DECREF(frame);
    return ok;
  }
  if (PyTuple_Check(where) && PyTuple_GET_SIZE(where) == 2 &&
      PyUnicode_Check(PyTuple_GET_ITEM(where, 0))) {
    long l = PyLong_AsLong(PyTuple_GET_ITEM(where, 1));
    if (l == -1 && PyErr_Occurred()) return false;
    *file = FileNamed(PyTuple_GET_ITEM(where, 0));
    *line = static_cast<int>(l);
    return *file != nullptr;
  }
  PyErr_SetString(PyExc_TypeError, "where must be (file, line) or a frame depth");
  return false;
}

}  // namespace torch_xla_donate
