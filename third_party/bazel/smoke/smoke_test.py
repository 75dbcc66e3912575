"""Smoke tests of the Bazel build: import torch_xla_donate from Bazel's output.

Run by //:c_import_test and //:package_import_test (the test class to run is
their only argument).  Both check that the module really comes from the
runfiles tree, not from a source checkout or an installed copy.
"""
import importlib
import os
import sys
import types
import unittest

PACKAGE = "torch_xla_donate"


def _workspace_dir():
    """The runfiles directory of this workspace (TEST_SRCDIR under bazel test)."""
    srcdir = os.environ.get("TEST_SRCDIR")
    workspace = os.environ.get("TEST_WORKSPACE")
    if srcdir and workspace:
        return os.path.join(srcdir, workspace)
    # bazel run / the binary run directly: this file is
    # <runfiles>/<workspace>/third_party/bazel/smoke/smoke_test.py.
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.normpath(os.path.join(here, "..", "..", ".."))


PACKAGE_DIR = os.path.join(_workspace_dir(), PACKAGE)
EXTENSION = os.path.join(PACKAGE_DIR, "_C.so")


class CImportTest(unittest.TestCase):
    """`import torch_xla_donate._C` alone: it is plain pybind11, no torch."""

    def test_import_c_without_torch(self):
        self.assertTrue(os.path.isfile(EXTENSION), EXTENSION + " is missing")
        # A bare parent package, so that importing _C does not run
        # torch_xla_donate/__init__.py (which imports torch_xla).
        parent = types.ModuleType(PACKAGE)
        parent.__path__ = [PACKAGE_DIR]
        sys.modules[PACKAGE] = parent

        C = importlib.import_module(PACKAGE + "._C")

        self.assertEqual(os.path.realpath(C.__file__), os.path.realpath(EXTENSION))
        self.assertNotIn("torch", sys.modules)
        step = C.current_step()
        self.assertIsInstance(step, int)
        self.assertGreaterEqual(step, 0)
        self.assertEqual(C.marked_count(), 0)
        print(f"torch_xla_donate._C from {C.__file__}: current_step() = {step}")


class PackageImportTest(unittest.TestCase):
    """`import torch_xla_donate`: the py_library with its extension module."""

    def test_import_package(self):
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        tdx = importlib.import_module(PACKAGE)

        self.assertEqual(
            os.path.abspath(os.path.dirname(tdx.__file__)), os.path.abspath(PACKAGE_DIR)
        )
        self.assertEqual(os.path.realpath(tdx._C.__file__), os.path.realpath(EXTENSION))
        self.assertIsInstance(tdx._C.current_step(), int)
        self.assertTrue(callable(tdx.donate_buffer))
        print(f"torch_xla_donate from {os.path.dirname(tdx.__file__)}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
