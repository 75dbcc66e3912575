// `_C.Trampoline(real, before, after)`: a callable that stands in for one of
// torch_xla's `_XLAC` functions (the step barrier, `_xla_sync_multi`, ...).
//
// Why native: torch_xla's debug analysis (PT_XLA_DEBUG) names the cause of
// an execution from the innermost *Python* frame when its C++ is entered.  A
// Python wrapper around `_xla_step_marker` would be that frame, and every
// step would be reported as "user code trying to access tensor value".  A
// Trampoline calls `before(*args, **kwargs)` and `after(token, result, error)`
// as Python functions, but calls `real(*args, **kwargs)` from C, when both
// of their frames are gone: torch_xla sees its own caller, as without us.
//
//   token = before(*args, **kwargs)      # raising: real is not called
//   if token is PASS: return real(*args, **kwargs)
//   result = real(*args, **kwargs)       # error: after(token, None, error),
//   return after(token, result, None)    #   then the error propagates
#pragma once

#include <Python.h>

namespace torch_xla_donate {

// Creates the type and registers `Trampoline` and `PASS` on `module`.
void RegisterTrampoline(PyObject* module);

}  // namespace torch_xla_donate
