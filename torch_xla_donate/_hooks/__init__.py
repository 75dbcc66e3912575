"""The hooks: where torch_xla's executions meet the marks.

* ``install``: puts the hooks in place and takes them out;
* ``executions``: which executions commit marks (native trampolines in
  place of ``_XLAC`` functions, the step-block hook);
* ``commit``: committing marks to an execution (split, arm, run, disarm,
  poison);
* ``dynamo``: ``torch.compile(backend="openxla")`` graphs;
* ``torchscript``: a donated tensor in TorchScript raises our error;
* ``gradient_accumulation``: its guard against donated model state.
"""
