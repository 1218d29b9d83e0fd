"""Builds the compiled core with Cython: the allocators (``runtime/_alloc``), C kernel
launches (``runtime/_launch``), the registry (``_registry``), ``HipBuffer`` (``buffer``),
``MemoryPool`` (``pool``), the attention's work split (``_worksplit``), the DLPack capsules'
release callbacks (``_dlpack_release``) and a decode step's bookkeeping (``_steprows``).
Plain C against Python's headers only: the GPU fast paths take the bindings' C functions at
run time, so neither cuda.h nor the ROCm headers are needed. Everything else is in
pyproject.toml.
"""

import shutil

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build import build

MODULES = ("rocmforge_raw.runtime._alloc", "rocmforge_raw.runtime._launch",
           "rocmforge_raw._registry", "rocmforge_raw.buffer", "rocmforge_raw.pool",
           "rocmforge_raw._worksplit", "rocmforge_raw._dlpack_release",
           "rocmforge_raw._steprows")

#: A step's loops over block tables want vectorizing (a copy fused with a range check, 2x
#: faster than glibc's memcpy and a check apart), which -O2 leaves undone.
OPTIMIZE = {"rocmforge_raw._steprows": "-O3"}
extensions = [Extension(name, [name.replace(".", "/") + ".pyx"],
                        extra_compile_args=[OPTIMIZE.get(name, "-O2"), "-Wno-array-bounds"])
              for name in MODULES]


class FreshBuild(build):
    """A build into an emptied ``build/lib.*``: a wheel or a ``pip install .`` holds what the
    tree holds now, never a module or compiled core an earlier build left there."""

    def run(self) -> None:
        shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()


setup(ext_modules=cythonize(extensions, compiler_directives={"language_level": 3}, quiet=True),
      cmdclass={"build": FreshBuild})
