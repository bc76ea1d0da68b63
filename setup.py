"""Builds jaxserve's native CPU kernels (jaxserve/native/csrc) with the package.

The extension is a plain shared library of XLA FFI handlers (no Python module init): jaxserve
loads it with ctypes and registers its handlers with jax (jaxserve.native). It needs XLA's FFI
headers, which ship with jaxlib (``jax.ffi.include_dir()``), so jax is a build requirement. The
extension is optional: a machine without a C++17 compiler still installs jaxserve, and
jaxserve then says at start-up that the native kernels are missing and runs XLA's paths.
"""
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


class BuildNative(build_ext):
    def build_extensions(self):
        try:
            import jax.ffi

            include = jax.ffi.include_dir()
        except Exception as e:  # noqa: BLE001 - the extension is optional
            print(f"warning: jaxserve native kernels not built: no XLA FFI headers ({e})")
            return
        for ext in self.extensions:
            ext.include_dirs.append(include)
        super().build_extensions()

    def get_export_symbols(self, ext):
        return []  # not a Python module: no PyInit_ symbol


setup(
    ext_modules=[Extension(
        "jaxserve.native._kernels",
        sources=["jaxserve/native/csrc/matmul.cc", "jaxserve/native/csrc/handlers.cc", "jaxserve/native/csrc/greedy.cc",
                 "jaxserve/native/csrc/attention.cc", "jaxserve/native/csrc/parallel.cc"],
        depends=["jaxserve/native/csrc/kernels.inc", "jaxserve/native/csrc/bf16.inc", "jaxserve/native/csrc/vnni.inc",
                 "jaxserve/native/csrc/walk.inc", "jaxserve/native/csrc/amx.inc", "jaxserve/native/csrc/amx_calls.inc", "jaxserve/native/csrc/isa.inc",
                 "jaxserve/native/csrc/madd.inc",
                 "jaxserve/native/csrc/rows.h", "jaxserve/native/csrc/parallel.h", "jaxserve/native/csrc/aligned.h",
                 "jaxserve/native/csrc/simd512.inc", "jaxserve/native/csrc/simd256.inc", "jaxserve/native/csrc/attention.inc"],
        language="c++",
        extra_compile_args=["-O3", "-std=c++17", "-Wno-attributes", "-Wno-return-type", "-Wno-psabi"],
        optional=True,
    )],
    cmdclass={"build_ext": BuildNative},
)
