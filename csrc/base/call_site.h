// Where a donation was made: the file:line every record names.
//
// Asking Python for it on every mark was most of a mark's cost: a frame's
// line number is found by scanning its code's line table from the start.
// So file names are shared per code object, and line numbers cached per
// (code, instruction).  The caches hold a reference to each code object they
// key on, so that an address is never reused while it is a key, and stop
// growing at a bound (a program that donates from more places pays the
// uncached price there).
#pragma once

#include <Python.h>

#include "base/ledger.h"

namespace torch_xla_donate {

// The (file, line) to blame: `where` is either a (file, line) tuple, or a
// number of frames to go up from the Python function that called into _C
// (1: its caller), as sys._getframe would.  False with a Python error.
bool ResolveWhere(PyObject* where, FilePtr* file, int* line);

// The shared FilePtr for a file name given as str.  Null with a Python error.
FilePtr FileNamed(PyObject* name);

}  // namespace torch_xla_donate
