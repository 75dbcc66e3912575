// How the native hot path reads and changes tensors.
//
// Questions about the torch tensor itself (device, storage sharing, sizes)
// are answered by torch's c10 headers (tensor_facts.h).  Questions for
// torch_xla go through Python callables that torch_xla_donate._xla hands
// over at import (`_C.bind`): torch_xla's wheel ships no C++ headers, and
// keeping every torch_xla call named in _base/xla.py keeps an upgrade's breakage
// in one place.  What C++ saves is the interpreter work around those calls:
// with thousands of donated tensors per step, a Python loop costs more than
// the torch_xla calls it makes.
//
// The three questions the hot path asks per tensor (its id, pending IR, a
// consumed buffer) are read in place instead (lazy/lazy_reads.h, about 260
// instructions for every fact against 1.6-3.8k per `_XLAC` call) once the
// self-test of _base/reads.py let native reads on; a read that declines (a
// CPU tensor, a functional wrapper awaiting a sync, ...) or native reads
// off (TORCH_XLA_DONATE_NATIVE_READS=0, a failed self-test) ask the bound
// callable, which gives the same answer.
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>
#include <vector>

#include "base/ledger.h"
#include "base/tensor_facts.h"
#include "lazy/lazy_reads.h"

namespace torch_xla_donate {

// The callables and types bound at import; see Bind() in module.cpp.
struct Hooks {
  PyObject* tensor_type = nullptr;   // torch.Tensor
  PyObject* donated_type = nullptr;  // poison._DonatedTensor (the mixin)
  // poison.py's on_donated_dispatch: what the donated key's fallback asks
  // when an operator meets a donated tensor (donated_key.h).
  PyObject* on_donated_dispatch = nullptr;

  bool torch_bound() const { return tensor_type != nullptr; }
  bool poison_bound() const { return donated_type && on_donated_dispatch; }
};

extern Hooks g_hooks;

// Raises pybind11::error_already_set unless `ok`.
void Check(bool ok);
// Throws unless every hook is bound (torch_xla_donate was imported).
void RequireBound();

bool IsTensor(PyObject* t);
bool IsDonatedType(PyObject* t);

// The address of a torch tensor's c10::TensorImpl (`t._cdata`, read in
// place: variable.h); 0 when `t` is no torch tensor.  Never fails.
uintptr_t ImplAddress(PyObject* t);
// The native facts of `t`.  1 read, 0 not a tensor or torch raised (the
// caller takes the Python route), -1 error.
int Facts(PyObject* t, TensorFacts* facts, bool with_sizes = true);
// C++ owners of t's TensorImpl beyond t and a leaf's AccumulateGrad: an
// autograd graph that saved it for backward.  1 held, 0 not, -1 error.
int HeldByAutograd(PyObject* t, const TensorFacts& facts);

// torch_xla's facts of `t` read in place, when native reads are on and the
// read does not decline (lazy_reads.h).  False: `t` is no plain device data
// (or donation is off).  Never fails.
bool ReadLazy(PyObject* t, LazyFacts* facts);

// Before a pass over `n` tensors no code has touched for a while: starts
// loading, level by level for all of them at once, the Python objects, then
// what the native reads read behind them (lazy_reads.h PrefetchLazy).
// Items that are no tensors are skipped; changes nothing.
void PrefetchTensors(PyObject* const* items, Py_ssize_t n);

// torch_xla, read in place (ReadLazy).  1 / 0, -1 on error.
// `_check_tensor_need_materialization`: no handle, and an IR value that is
// no device data; also true for a tensor the reader declines (no plain
// device data).  False for a consumed tensor.
int HasPendingIr(PyObject* t);
// `_is_placecholder`: a handle without a value.  True for a consumed buffer
// and for an output still being computed; false for a tensor without a
// handle (pending IR, not yet uploaded).  Raises for a tensor the reader
// declines.
int BufferDeleted(PyObject* t);
// HasPendingIr of each tensor of `list` (a Python list), into `out`.
// False with a TypeError for an item that is no XLA tensor.
bool PendingFlags(PyObject* list, std::vector<char>* out);

// True when the one reference its entry holds is the only way to reach `t`
// (no other Python reference, no weak reference, no C++ owner of its
// TensorImpl).  The caller must hold no reference of its own.  1/0, -1 error.
int OnlyHeldByItsEntry(PyObject* t);

}  // namespace torch_xla_donate
