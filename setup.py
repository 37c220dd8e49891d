"""Only declares the C extension; all metadata lives in pyproject.toml.

gefen._kmeans_dp is plain C99 (no Python C-API) loaded with ctypes by gefen.codebook;
setuptools merely compiles it next to the package (in place for editable installs).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("gefen._kmeans_dp", ["gefen/csrc/kmeans_dp.c"], extra_compile_args=["-O3"]),
    ]
)
