"""The package build compiles bivit's CPU kernels (src/bivit/kernels/build.py says which and how), so that an
installed bivit never compiles anything: `pip install .`, `pip install -e .` and `python -m build --wheel` all
run this. Everything else about the package is in pyproject.toml."""

import importlib.util
import platform
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).parent
KERNELS = HERE / "src" / "bivit" / "kernels"


def _build_table():
    # Loaded from its file: importing the bivit package would import torch, which the build does not need.
    spec = importlib.util.spec_from_file_location("bivit_kernel_build", KERNELS / "build.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _target_machine() -> str:
    # sysconfig's platform names the target of a cross build (e.g. linux-aarch64); else this machine.
    plat = sysconfig.get_platform()
    return plat.rsplit("-", 1)[-1] if "-" in plat else platform.machine()


build = _build_table()
headers = sorted(str(p.relative_to(HERE)) for p in KERNELS.glob("*.h"))
extensions = [
    Extension(f"{build.PACKAGE}.{v.module}", sources=[str((KERNELS / v.source).relative_to(HERE))], depends=headers,
              extra_compile_args=[*build.COMMON_CFLAGS, *v.cflags], extra_link_args=list(build.LINK_FLAGS))
    for v in build.buildable(_target_machine())
]

OPTIONAL = {f"{build.PACKAGE}.{v.module}" for v in build.VARIANTS if v.x86_only}


class BuildKernels(build_ext):
    """A compiler too old for a variant's instruction set (gcc < 10 has no -mavx512bf16) builds bivit without that
    variant, and says so; at run time the next variant the CPU runs is taken (same bits). `portable` must build."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as e:  # noqa: BLE001 - distutils' CompileError/LinkError, and the compiler not running
            if ext.name not in OPTIONAL:
                raise
            print(f"bivit: not building {ext.name} ({e}): the install runs the next variant the CPU allows",
                  file=sys.stderr)


# The variants compile in parallel (the avx512 one takes most of the time).
setup(ext_modules=extensions, cmdclass={"build_ext": BuildKernels},
      options={"build_ext": {"parallel": len(extensions)}})
