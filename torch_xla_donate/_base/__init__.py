"""The base: what every other part of the package stands on, and that
imports nothing above it (test/base/test_layering.py checks).

* ``native``: the one owner of the native library ``_C``;
* ``xla``: the one owner of torch_xla's private ``_XLAC`` calls;
* ``reads``: torch_xla's answers about a tensor, read natively;
* ``guards``: what lets those reads (and the walk, arena.py, and the
  poison's key) on, once per process;
* ``compat``: supported releases and their differences;
* ``config``: the switches; ``errors``: what a user can meet;
* ``lock``: the one lock of the critical sections;
* ``sites``, ``messages``, ``dtypes``: the user's line, warning texts, and
  how a tensor is named;
* ``xla_cpu``: right values on the CPU backend (XNNPACK off).
"""
