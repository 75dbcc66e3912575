"""Build torch_xla_donate: the Python package and its native ledger `_C`.

Build without isolation so the build uses the installed pybind11 and torch:
    pip install --no-build-isolation -e .
"""
import glob
import os

import torch
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

# csrc/tensor_facts.cpp and csrc/record_tag.cpp reach tensors through torch's
# c10 headers (they ship in the torch wheel); the module links libc10.
# -idirafter: torch/include also holds a copy of pybind11, which must not
# shadow the pybind11 we build with.
TORCH_DIR = os.path.dirname(torch.__file__)
TORCH_INCLUDE = os.path.join(TORCH_DIR, "include")
TORCH_LIB = os.path.join(TORCH_DIR, "lib")
CXX11_ABI = int(torch._C._GLIBCXX_USE_CXX11_ABI)

ext = Pybind11Extension(
    "torch_xla_donate._C",
    sources=sorted(glob.glob("csrc/*.cpp")),
    include_dirs=["csrc"],
    extra_compile_args=["-idirafter", TORCH_INCLUDE, f"-D_GLIBCXX_USE_CXX11_ABI={CXX11_ABI}"],
    library_dirs=[TORCH_LIB],
    libraries=["c10"],
    runtime_library_dirs=[TORCH_LIB],
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
