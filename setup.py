"""Builds the compiled core with Cython: the allocators and C kernel launches
(``runtime/_alloc``, ``runtime/_launch``), device memory (``memory/``: the registry, ``HipBuffer``,
``MemoryPool`` over its stream-ordered core, the DLPack capsules' release callbacks), the
attention's work split, the multi-token launch's items and a step's packing
(``kernels/planning/_worksplit``, ``_prefill``, ``kernels/_pack``), a step's bookkeeping
(``cache/blocks/_tables``, ``_rows``) and an import's ids and spans (``cache/transfer/_spans``).
Plain C against Python's headers only: the GPU fast paths take the bindings' C functions at
run time, so neither cuda.h nor the ROCm headers are needed. Everything else is in pyproject.toml.
"""

import shutil

from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build import build

MODULES = ("rocmforge_raw.runtime._alloc", "rocmforge_raw.runtime._launch",
           "rocmforge_raw.memory._registry", "rocmforge_raw.memory.buffer",
           "rocmforge_raw.memory._pool_core", "rocmforge_raw.memory.pool",
           "rocmforge_raw.memory._dlpack_release",
           "rocmforge_raw.kernels.planning._worksplit", "rocmforge_raw.kernels.planning._prefill",
           "rocmforge_raw.kernels._pack",
           "rocmforge_raw.cache.blocks._tables", "rocmforge_raw.cache.blocks._rows",
           "rocmforge_raw.cache.transfer._spans")

#: A step's loops over block tables want vectorizing (a copy fused with a range check, 2x
#: faster than glibc's memcpy and a check apart), which -O2 leaves undone.
OPTIMIZE = {name: "-O3" for name in ("rocmforge_raw.kernels._pack",
                                     "rocmforge_raw.cache.blocks._tables",
                                     "rocmforge_raw.cache.blocks._rows")}
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
