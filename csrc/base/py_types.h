// The Python faces of the ledger: `_C.Record` (one donation), `_C.Entry`
// (a (tensor, record) pair of a step's donors or open verdicts) and the
// members of the IntEnum `_C.Verdict`.
//
// Both are small native types rather than pybind11 classes: a step creates
// one Entry per donated tensor, and a pybind11 instance costs several times
// more to create and to read (`record.verdict`).  An Entry holds its
// record natively and makes its Record object only when Python asks for it:
// the common step's native passes make none.
#pragma once

#include <Python.h>

#include <cstdint>
#include <vector>

#include "base/ledger.h"
#include "lazy/lazy_reads.h"

namespace torch_xla_donate {

// Creates the types and registers Record, Entry and Verdict on `module`.
// Throws pybind11::error_already_set on failure.
void RegisterPyTypes(PyObject* module);

// A new Record wrapping `record`, or nullptr with a Python error.
PyObject* WrapRecord(RecordPtr record);
bool IsRecord(PyObject* o);
// The record of a `_C.Record` (no type check: see IsRecord).
const RecordPtr& Unwrap(PyObject* o);
// The record of `o`, or a TypeError (pybind11::type_error) if it is none.
const RecordPtr& RecordArg(PyObject* o);

// Ledger::BeginStep with its Python faces: the marks (all, or those of the
// tensors in `only`) committed to a new step, as a list of the tensors and
// a list of their Records (new references).  False with a Python error.
bool BeginStepLists(const std::vector<PyObject*>* only, int64_t* step, PyObject** tensors,
                    PyObject** records);
// A new list of Records wrapping `records`, or nullptr with a Python error.
PyObject* RecordList(const std::vector<RecordPtr>& records);

// A new (tensor, record) Entry, or nullptr with a Python error: of a Record
// object, or of the record itself (its Record object is made when Python
// first asks for it).
PyObject* NewEntry(PyObject* tensor, PyObject* record);
PyObject* NewEntry(PyObject* tensor, const RecordPtr& record);
// The borrowed tensor and record of an Entry or of a (tensor, Record)
// 2-tuple; false if `o` is neither.
bool EntryParts(PyObject* o, PyObject** tensor, const RecordPtr** record);

// Lets an Entry's tensor go, keeping only `buffer` (which it takes) for the
// verdict, on the record until the verdict is in or the entry goes
// (Record::held): the entry's tensor reads as None from then on.  Dropping
// the tensor may free it, and run its weak references' callbacks.  False
// (the buffer not taken) if `entry` is no Entry or was released or
// weakened already.
bool ReleaseEntryTensor(PyObject* entry, HeldBuffer* buffer);
// The same for a tensor someone else holds, kept weakly (variable.h
// WeakTensorTake): indexing or unpacking the entry gives the tensor while
// it lives, then None; native code reading the entry in place (EntryParts)
// sees None.  Also false if the tensor cannot be kept weakly.
bool WeakenEntryTensor(PyObject* entry, HeldBuffer* buffer);
// Lets go of what an Entry keeps of its weakened tensor once that died: the
// weak reference (which keeps the TensorImpl's memory, and what it holds),
// where the tensor's finalizer did not already (WeakenedTensorDying).
// Nothing for anything else.
void EntryLetGoOfDead(PyObject* entry);
// A tensor's Python object is about to die, the last owner of the
// TensorImpl at `impl` (outcomes/poison.h WatchDeaths): the entry that
// keeps it weakly, if any, lets go of its weak reference, so that the
// TensorImpl dies with the object.  With the GIL.
void WeakenedTensorDying(uintptr_t impl);
// The buffer a released or weakened Entry keeps, or nullptr (a tuple, an
// entry holding its tensor, one whose verdict is in).
const HeldBuffer* EntryBuffer(PyObject* entry);
// Whether a tensor still leads to the buffer an Entry keeps: false for a
// released entry (nobody held its tensor) and for a weakened one whose
// tensor died; true while a weakened tensor lives, and for anything that
// keeps no buffer alone (an entry holding its tensor, a record, a tuple).
bool EntryTensorAlive(PyObject* entry);
// Before a pass over many entries no code has touched since the last step
// (a barrier's settle): starts loading, level by level for all of them at
// once, what EntryBuffer and a verdict read (the Entry, its record, the
// held buffer and its BackendData).  Each level's
// addresses come from the one before, so a pass that reads entry by entry
// waits for each miss in turn; here the misses of all entries overlap.
// Reads only what it prefetched one level before; changes nothing.
void PrefetchEntries(PyObject* list);

// A new reference to the `_C.Verdict` member for `v`.
PyObject* VerdictObject(Verdict v);
constexpr int kVerdictCount = static_cast<int>(Verdict::kCancelled) + 1;

}  // namespace torch_xla_donate
