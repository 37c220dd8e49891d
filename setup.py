"""Only declares the C extensions; all metadata lives in pyproject.toml.

gefen._kmeans_dp, gefen._gefen_step (the fused step and the first step's statistics) and
gefen_ckpt._native (the checkpoint checksum and I/O loops) are plain C99 (no Python C-API) loaded with ctypes by
gefen.codebook, gefen.c_kernels and gefen_ckpt.io.native; setuptools merely compiles them next to the package (in place
for editable installs).  _gefen_step and _kmeans_dp use OpenMP when the compiler has it (else they are
built serial); _gefen_step is optional: without it gefen runs the eager torch step.
"""

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildExt(build_ext):
    """Retry an extension without OpenMP when the compiler rejects -fopenmp."""

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception:
            if "-fopenmp" not in ext.extra_compile_args:
                raise
            ext.extra_compile_args = [a for a in ext.extra_compile_args if a != "-fopenmp"]
            ext.extra_link_args = [a for a in ext.extra_link_args if a != "-fopenmp"]
            super().build_extension(ext)


setup(
    ext_modules=[
        Extension("gefen._kmeans_dp", ["gefen/csrc/kmeans_dp.c"], depends=["gefen/csrc/gefen_common.h"],
                  extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off"], extra_link_args=["-fopenmp"]),
        # -ffp-contract=off: no implicit fused multiply-adds; bit-parity with torch depends on it.
        Extension("gefen._gefen_step", ["gefen/csrc/gefen_step.c", "gefen/csrc/first_step.c",
                                                  "gefen/csrc/m4v4_step.c"], optional=True,
                  depends=["gefen/csrc/gefen_common.h"],
                  extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-math-errno"],
                  extra_link_args=["-fopenmp"]),
        # CRC-32 with carry-less multiplies and the hashed reads/writes; optional: gefen_ckpt falls
        # back to zlib.crc32 and Python I/O.
        Extension("gefen_ckpt._native", ["gefen_ckpt/csrc/crc32.c", "gefen_ckpt/csrc/file_io.c"], optional=True,
                  depends=["gefen_ckpt/csrc/native.h"],
                  extra_compile_args=["-O3", "-pthread"], extra_link_args=["-pthread"]),
    ],
    cmdclass={"build_ext": BuildExt},
)
