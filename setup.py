"""Build torch_xla_donate: the Python package and its native ledger `_C`.

Build without isolation so the build uses the installed pybind11 and torch
(the extension's ABI follows it), into an environment with torch and
torch_xla 2.7, 2.8 or 2.9:
    pip install --no-build-isolation .        # or -e . to develop
"""
import glob
import os
import re

import torch
from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import find_packages, setup

# csrc/base/tensor_facts.cpp and csrc/outcomes/record_tag.cpp reach tensors
# through torch's c10 headers, csrc/base/variable.cpp through the inline code
# of torch's python_variable.h (all ship in the torch wheel);
# csrc/lazy/lazy_reads.cpp and live_tensors.cpp through torch's lazy-tensor headers, whose
# out-of-line functions (LazyTensor::data(), torch::lazy::getBackend(), ...)
# libtorch_cpu exports: the module links libc10 and libtorch_cpu.
# -idirafter: torch/include also holds a copy of pybind11, which must not
# shadow the pybind11 we build with.
# One place for the version: the package's __version__, read without importing
# it (importing it needs the extension this builds).
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_xla_donate", "__init__.py")) as f:
    VERSION = re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

TORCH_DIR = os.path.dirname(torch.__file__)
TORCH_INCLUDE = os.path.join(TORCH_DIR, "include")
TORCH_LIB = os.path.join(TORCH_DIR, "lib")
CXX11_ABI = int(torch._C._GLIBCXX_USE_CXX11_ABI)

ext = Pybind11Extension(
    "torch_xla_donate._C",
    sources=sorted(glob.glob("csrc/**/*.cpp", recursive=True)),
    depends=sorted(glob.glob("csrc/**/*.h", recursive=True)),
    include_dirs=["csrc"],
    extra_compile_args=["-idirafter", TORCH_INCLUDE, f"-D_GLIBCXX_USE_CXX11_ABI={CXX11_ABI}"],
    # The torch this is built against: the extension refuses another at import.
    define_macros=[("TDX_BUILT_FOR_TORCH", f'"{torch.__version__}"')],
    library_dirs=[TORCH_LIB],
    libraries=["c10", "torch_cpu", "dl"],  # dl: variable.cpp finds THPVariable_Wrap
    runtime_library_dirs=[TORCH_LIB],
    cxx_std=17,
)



class BuildForThisTorch(build_ext):
    """Rebuilds everything when the installed torch is not the one the last
    build in this tree used.

    The tricky case: one checkout, several virtualenvs (tools/dev.sh keeps one
    per torch_xla release).  setuptools rebuilds only sources newer than the
    built extension, so after switching environments it would keep (and put
    into wheels) an extension built against the other torch, which the import
    check then refuses.  A stamp in the build directory names the torch.
    """

    def run(self):
        stamp = os.path.join(self.build_temp, "built-for-torch")
        try:
            with open(stamp) as f:
                self.force = self.force or f.read() != torch.__version__
        except FileNotFoundError:
            self.force = True
        super().run()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(torch.__version__)


setup(
    name="torch_xla_donate",
    version=VERSION,
    description="Explicit buffer donation for PyTorch/XLA step barriers",
    packages=find_packages(include=["torch_xla_donate", "torch_xla_donate.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": BuildForThisTorch},
    python_requires=">=3.10",
    # torch_xla 2.7 to 2.9, each with the torch of the same release (checked
    # at import: torch_xla's own wheels do not pin torch).
    install_requires=["torch>=2.7,<2.10", "torch_xla>=2.7,<2.10", "numpy"],
)
