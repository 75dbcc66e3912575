// The donation record of a poisoned tensor, carried by its c10::TensorImpl.
//
// Why not the tensor's Python __dict__, as poisoning first did: the first
// attribute set on a tensor allocates its __dict__, an object the garbage
// collector counts.  One per donated tensor per step doubled the number of
// young-generation collections of a training loop (and with them the full
// collections, which walk every object of the process).  c10 lets code hang
// a c10::BackendMeta on any TensorImpl; ours holds the record, is freed with
// the tensor, and is not copied to the shallow copies torch makes of it
// (detach, .data): those are not donated.
//
// Like tensor_facts.h this needs only the TensorImpl's address (`t._cdata`),
// and no torch type leaks out.
#pragma once

#include <cstdint>
#include <string>

#include "base/ledger.h"

namespace torch_xla_donate {

// Tags the TensorImpl at `impl` with `record`, replacing an earlier tag of
// ours.  Whatever backend meta it held before is kept aside and comes back
// with UntagRecord.  `note` says how a tensor that was not itself marked
// came to lose its buffer with the donation (ownership.py's companions:
// "it is parameter 'fc1.weight' of Net, which shared its storage"); empty
// for the donated tensor.  False if torch raised.
bool TagRecord(uintptr_t impl, RecordPtr record, std::string note = std::string());

// The record the TensorImpl at `impl` is tagged with, or null.
RecordPtr TaggedRecord(uintptr_t impl);

// The note of the tag, or "" (no tag, or the donated tensor itself).
std::string TaggedNote(uintptr_t impl);

// Removes our tag (restoring what it replaced); no tag: nothing happens.
void UntagRecord(uintptr_t impl);

}  // namespace torch_xla_donate
