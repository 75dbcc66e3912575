// Dead step inputs: device buffers the coming step barrier reads that
// nothing but the step's own IR graph holds any more.
//
// The problem: `xs = [x * 0.9 + 1 for x in xs]` rebinds the list, so the old
// tensors die, but their buffers live on inside the pending IR (each
// `xla::device_data` node holds its BackendData) until the barrier has
// computed the new values.  Donating them would let XLA write the outputs
// in place; no Python object is left to mark.  Walking the garbage
// collector to find the pending tensors costs 200-450 ms a step.
//
// Here, natively: torch_xla's live tensors (its registry, walked by
// lazy/live_tensors.h) are walked once; the pending ones (no buffer, an IR
// node that is not device data) are the roots of a post-order walk of their
// IR (a visited set: shared subgraphs once) down to the device-data nodes.
// A node's buffer is dead when its shared_ptr count is the node's own plus
// this walk's copy: no live tensor's handle, no cache (torch_xla's data
// cache holds scalars and 0-dim constants; the RNG seed has its holder), no
// second node.  A device-data node that is itself a live tensor's IR value
// (a copy made since the last barrier, which the barrier backs with that
// buffer) is never dead, nor is one that the IR of a live tensor the barrier leaves
// alone reads (a buffer and a non-device-data IR value at once: not seen in
// the tests, guarded anyway).  The tricky case that the count cannot tell: none
// known; every miss errs towards "held" (a buffer reached through two nodes
// counts 3 and is kept).
//
// Arming uses only torch types and one torch_xla binding: a carrier XLA
// tensor's `LazyTensor::Data::handle` points at the dead buffer for the
// duration of one `_XLAC._set_buffer_donation(carrier, flag)` call, which
// reads nothing but that handle, then gets its own back.
#pragma once

#include <Python.h>

namespace torch_xla_donate {

// Registers find_dead_inputs and the DeadInputs type on `module`.
void RegisterDeadInputs(PyObject* module);

}  // namespace torch_xla_donate
