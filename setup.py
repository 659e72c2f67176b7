"""Build of flashqla's extension module flashqla._C.

Sources, one folder per layer (DESIGN §4): csrc/gdn.h + csrc/gdn_common.c (the C
API), csrc/cpu/ (CPU backend), csrc/cuda/ (CUDA backend), csrc/python/ (the CPython
binding).
C (C11): every csrc/**/*.c, except csrc/cuda/gdn_cuda_stub.c when CUDA is built.
CUDA: when nvcc is found (CUDA_HOME/bin, CUDA_PATH/bin, or PATH) and
FLASHQLA_NO_CUDA is not set, every csrc/cuda/*.cu is compiled with nvcc (in
parallel across files) and linked with the static CUDA runtime; otherwise
csrc/cuda/gdn_cuda_stub.c stands in and the build is CPU-only.

Environment:
    FLASHQLA_NO_CUDA=1            CPU-only build even where nvcc exists
    FLASHQLA_NATIVE=1             -march=native for the whole library (a build for
                                  this machine only); default: portable, baseline
                                  x86-64 / AArch64, the per-ISA CPU kernels
                                  (csrc/cpu/gdn_cpu_kernels_<isa>.c) carry their
                                  own target pragmas and are picked at run time
    FLASHQLA_NO_XLA_FFI=1         no XLA FFI handlers (csrc/xla/; flashqla.jax then says so)
    FLASHQLA_XLA_FFI_INCLUDE=DIR  the folder with xla/ffi/api/c_api.h (default: jaxlib's, if
                                  importable at build time, else csrc/third_party's copy)
    CUDA_HOME / CUDA_PATH         the CUDA toolkit to use
    MAX_JOBS=N                    parallel compiler processes
"""

import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"

C_FLAGS = ["-std=c11", "-O3", "-fno-math-errno", "-ffp-contract=fast", "-pthread", "-fPIC",
           "-Wall", "-Wextra"]
NVCC_FLAGS = ["-std=c++17", "-O3", "-lineinfo", "--use_fast_math", "-Xcompiler", "-fPIC",
              "-gencode", "arch=compute_90a,code=sm_90a",
              "-gencode", "arch=compute_80,code=compute_80",
              "--threads", "2"]


def env_flag(name):
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no", "off")


def find_cuda():
    """(cuda_root, nvcc) or (None, None) for a CPU-only build."""
    if env_flag("FLASHQLA_NO_CUDA"):
        return None, None
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.isfile(os.path.join(root, "bin", "nvcc")):
            return root, os.path.join(root, "bin", "nvcc")
    nvcc = shutil.which("nvcc")
    if nvcc:
        nvcc = os.path.realpath(nvcc)
        return os.path.dirname(os.path.dirname(nvcc)), nvcc
    return None, None


def c_flags():
    flags = list(C_FLAGS)
    if env_flag("FLASHQLA_NATIVE"):
        flags.insert(2, "-march=native")
    return flags


def max_jobs():
    try:
        return max(1, int(os.environ["MAX_JOBS"]))
    except (KeyError, ValueError):
        return max(1, os.cpu_count() or 1)


def newer_than(target, sources):
    """True if target is missing or older than any of sources."""
    if not os.path.exists(target):
        return True
    t = os.path.getmtime(target)
    return any(os.path.getmtime(s) > t for s in sources if os.path.exists(s))


def find_xla_ffi():
    """The folder holding xla/ffi/api/c_api.h for csrc/xla/ (the XLA FFI
    handlers), or None: FLASHQLA_XLA_FFI_INCLUDE if set; else the jaxlib of
    the build environment (the folder jax.ffi.include_dir() names, found
    without importing jax); else the copy in csrc/third_party (pip's isolated
    build has no jaxlib). FLASHQLA_NO_XLA_FFI=1 builds without the handlers."""
    if env_flag("FLASHQLA_NO_XLA_FFI"):
        return None
    header = os.path.join("xla", "ffi", "api", "c_api.h")
    candidates = [os.environ.get("FLASHQLA_XLA_FFI_INCLUDE")]
    try:
        import importlib.util
        spec = importlib.util.find_spec("jaxlib")
        if spec is not None and spec.origin:
            candidates.append(os.path.join(os.path.dirname(spec.origin), "include"))
    except (ImportError, ValueError):
        pass
    candidates.append(os.path.join(HERE, CSRC, "third_party"))
    for d in candidates:
        if d and os.path.isfile(os.path.join(d, header)):
            return d
    return None


CUDA_ROOT, NVCC = find_cuda()
XLA_FFI_INCLUDE = find_xla_ffi()
C_SOURCES = sorted(glob(os.path.join(CSRC, "**", "*.c"), recursive=True))
CU_SOURCES = sorted(glob(os.path.join(CSRC, "cuda", "*.cu"))) if NVCC else []
STUB = os.path.join(CSRC, "cuda", "gdn_cuda_stub.c")
if NVCC:
    C_SOURCES = [s for s in C_SOURCES if os.path.normpath(s) != os.path.normpath(STUB)]
HEADERS = sorted(glob(os.path.join(CSRC, "**", "*.h"), recursive=True)
                 + glob(os.path.join(CSRC, "**", "*.cuh"), recursive=True))


class BuildExt(build_ext):
    """Compiles C files with the C compiler and .cu files with nvcc, each set
    in parallel across files, then links everything into flashqla._C.
    Objects newer than their source and every header are reused."""

    def build_extension(self, ext):
        objects = []
        if ext.name == "flashqla._C":
            objects = self._compile_all(ext)
        else:  # pragma: no cover - only one extension here
            return super().build_extension(ext)
        ext_path = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(ext_path) or ".", exist_ok=True)
        library_dirs, libraries = [], ["m"]
        if NVCC:
            for sub in ("lib64", os.path.join("targets", "x86_64-linux", "lib"), "lib"):
                d = os.path.join(CUDA_ROOT, sub)
                if os.path.isdir(d):
                    library_dirs.append(d)
            # static runtime: the .so needs no libcudart at run time, only the driver
            libraries += ["cudart_static", "dl", "rt", "pthread", "stdc++"]
        self.compiler.link_shared_object(
            objects, ext_path,
            libraries=libraries, library_dirs=library_dirs,
            extra_postargs=["-pthread"],
            export_symbols=self.get_export_symbols(ext),
            build_temp=self.build_temp, target_lang="c")
        self._check_core_symbols(ext_path)

    @staticmethod
    def _check_core_symbols(ext_path):
        """Fails the build (instead of the import) when a gdn.h entry point
        has no definition, e.g. a backend file missing from csrc/."""
        nm = shutil.which("nm")
        if not nm:
            return
        proc = subprocess.run([nm, "-u", ext_path], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
        missing = sorted({line.split()[-1] for line in proc.stdout.splitlines()
                          if line.split() and line.split()[-1].startswith("fq_")})
        if missing:
            raise RuntimeError("flashqla._C: undefined core symbols (no csrc file defines them): "
                               + ", ".join(missing))

    def _compile_all(self, ext):
        obj_dir = os.path.join(self.build_temp, "flashqla_objs")
        os.makedirs(obj_dir, exist_ok=True)
        include = [os.path.join(HERE, CSRC)] + list(ext.include_dirs) + list(self.include_dirs or [])
        if XLA_FFI_INCLUDE:
            include.append(XLA_FFI_INCLUDE)
        jobs = []
        for src in ext.sources:
            obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
            jobs.append((self._compile_c, src, obj, include))
        for src in CU_SOURCES:
            obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
            jobs.append((self._compile_cu, src, obj, include))
        # nvcc runs 2 threads itself: leave room for them
        workers = max(1, min(len(jobs), max_jobs() if not NVCC else max(1, max_jobs() // 2)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(fn, src, obj, inc) for fn, src, obj, inc in jobs]
            objects = [f.result() for f in futures]  # re-raises a compile error
        return objects

    def _compile_c(self, src, obj, include):
        if not (self.force or newer_than(obj, [src] + HEADERS)):
            return obj
        defines = ["-DFQ_HAVE_XLA_FFI"] if XLA_FFI_INCLUDE else []
        cmd = (list(self.compiler.compiler_so) + [f"-I{d}" for d in include]
               + c_flags() + defines + ["-c", src, "-o", obj])
        self._spawn(cmd)
        return obj

    def _compile_cu(self, src, obj, include):
        if not (self.force or newer_than(obj, [src] + HEADERS)):
            return obj
        cmd = ([NVCC] + NVCC_FLAGS + [f"-I{d}" for d in include]
               + ["-c", src, "-o", obj])
        self._spawn(cmd)
        return obj

    @staticmethod
    def _spawn(cmd):
        print(" ".join(cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if proc.stdout:
            print(proc.stdout, end="", flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"command failed with exit code {proc.returncode}: {' '.join(cmd)}")


def long_description():
    path = os.path.join(HERE, "README.md")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return "Gated DeltaNet (gated delta rule) kernels for CPU and NVIDIA Hopper."


if XLA_FFI_INCLUDE:
    print(f"flashqla: XLA FFI handlers for JAX, header from {XLA_FFI_INCLUDE}", file=sys.stderr)
else:
    print("flashqla: no XLA FFI header (FLASHQLA_NO_XLA_FFI=1, or none found): flashqla.jax "
          "will not work", file=sys.stderr)
if NVCC:
    print(f"flashqla: building with CUDA ({NVCC})", file=sys.stderr)
else:
    print("flashqla: building CPU-only (no nvcc found, or FLASHQLA_NO_CUDA=1)", file=sys.stderr)

setup(
    long_description=long_description(),
    long_description_content_type="text/markdown",
    ext_modules=[
        Extension(
            "flashqla._C",
            sources=C_SOURCES,
            include_dirs=[CSRC],
            depends=HEADERS + CU_SOURCES,
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
