"""Build torch_xla_donate: the Python package and its native ledger `_C`.

Build without isolation so the build uses the installed pybind11:
    pip install --no-build-isolation -e .
"""
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

ext = Pybind11Extension(
    "torch_xla_donate._C",
    sources=["csrc/ledger.cpp", "csrc/module.cpp"],
    include_dirs=["csrc"],
    cxx_std=17,
)

setup(
    name="torch_xla_donate",
    version="0.1.0",
    description="Explicit buffer donation for PyTorch/XLA step barriers",
    packages=find_packages(include=["torch_xla_donate", "torch_xla_donate.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": build_ext},
    python_requires=">=3.10",
    install_requires=["torch==2.9.0", "torch_xla==2.9.0", "numpy"],
)
