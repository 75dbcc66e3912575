// A consumed tensor's refusal, natively: a dispatch key of its own.
//
// The problem: poisoning must make every operator on a donated tensor
// raise, whoever calls it (Python, autograd's engine, torch.func, jit), so
// the refusal sits in c10's dispatcher, on the TensorImpl torch_xla computes
// with (for a functional tensor, the one its wrapper holds).  The Python
// dispatch key does that, but only through a Python object of that inner
// tensor with a class whose __torch_dispatch__ raises: one object made,
// re-classed, kept and freed (with a GIL hand-off in torch's deallocation)
// per donor and step, about 2.3k instructions of a held loop's donor.
//
// Here: the inner TensorImpl takes one more dispatch key, whose fallback
// (one for every operator, registered once) finds the donated tensors among
// the arguments (the key and a record tag, record_tag.h) and hands them to
// poison.py's `on_donated_dispatch`, which settles an in-flight verdict,
// raises DonatedBufferError for a consumed one, or lets a refill or an
// unused donation through; the operator then goes on below the key.  No
// Python object is made for the inner tensor; tensors without the key pay
// nothing (the dispatcher looks at keys the arguments have).
//
// The key: c10 has no key for extensions but Python's and the backends'.
// TESTING_ONLY_GenericWrapper is a functionality key torch registers
// nothing for outside its C++ tests; above every key an inner tensor is
// dispatched through (so functionalization's calls reach it), never put on
// a tensor by torch.  The key set is a protected member of c10::TensorImpl
// (torch's own headers; nothing of torch_xla).  Guarded: the fallback is
// registered only if the key has none, then a self-test on a real XLA
// tensor (SelfTestDonatedKey) must see an operator refused with the key and
// run without it; otherwise, or with TORCH_XLA_DONATE_NATIVE_POISON=0,
// poisoning keeps the Python dispatch key (poison.py's twin).
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>

namespace torch_xla_donate {

// Whether poisoning uses the key (SelfTestDonatedKey passed and it is on).
bool DonatedKeyInUse();

// The key on the TensorImpl at `impl`, on or off.
void SetDonatedKey(uintptr_t impl, bool on);
bool HasDonatedKey(uintptr_t impl);

// Registers the fallback (once) and tries the key on `probe`, an XLA tensor
// the caller made for it: "" and the key in use, or why not (left off).
std::string SelfTestDonatedKey(PyObject* probe);

// Registers donated_key_* on `module`.
void RegisterDonatedKey(PyObject* module);

}  // namespace torch_xla_donate
