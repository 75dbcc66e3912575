"""Marking: recording a user's promise that a tensor is dead after the next
step.  Marking only records (and refuses what cannot be donated); torch_xla
sees nothing until a commit (``_hooks``).  Never imports ``_hooks``.

* ``checks``: what can be donated, and the error that says why not;
* ``marks``: one tensor into the ledger, or a warning that donation is off;
* ``tensor``: ``donate_buffer``, ``is_donated``, ``is_deleted``;
* ``walk``: the one walk over a tree every entry point uses (its leaves,
  paths and refusals);
* ``trees``: ``donate`` and ``undonate`` of pytrees, modules, optimizers;
* ``donating``, ``selection``: the wrapper and its argument selection;
* ``graph_ops``: what marking becomes while dynamo traces it.
"""
