// Marking: the rules of what can be marked, in one function (Classify), and
// the mark itself.  Python words each refusal (_marking/refusals.py) and
// does what only Python can: warn, judge who holds an alias, make a
// poisoned twin class.
//
// Marking only records: torch_xla's donor flag is set inside the execution
// that commits the marks (hooks/commit.h), on the buffer each tensor holds
// at that moment.
#pragma once

#include <Python.h>

namespace torch_xla_donate {

// Why a tensor is not marked.  Values are Python's too (C.Refusal).
enum class Refusal : int {
  kNone = 0,    // marked (or marked already)
  kNotTensor,   // no torch.Tensor
  kWrapper,     // a subclass with its own __torch_dispatch__: no buffer of its own
  kPoisoned,    // donated before: Python settles its verdict, then asks again
  kNewClass,    // a class poisoning has no twin for yet: Python makes one, asks again
  kNotXla,      // not on an XLA device
  kView,        // a view of another tensor's buffer
  kZeroDim,     // a scalar: never donated
  kOff,         // donation is switched off (config, XLA_ENABLE_PARAM_ALIASING, a guard)
  kUndecided,   // the guards (_base/guards.py) have not run yet: Python runs them
  kWarnFirst,   // a StaleReadWarning is owed first (_base/xla_cpu.py)
  kCommitting,  // another thread is inside a commit: Python takes the lock, asks again
  kPending,     // pending computation, or no plain device data: no buffer yet
  kCopy,        // a copy made since the last barrier: it holds its source's buffer
  kHeld,        // views, aliases or an autograd graph hold it: Python judges them
};

// Registers try_mark, try_mark_all, classify_meta, the twin classes and the
// switches marking reads (set_marking_state, note_lock, set_settled_ids, ...)
// on `module`.
void RegisterMarking(PyObject* module);

// The poisoned twin class registered for `type` (borrowed), or nullptr.
PyObject* TwinClassOf(PyTypeObject* type);

}  // namespace torch_xla_donate
