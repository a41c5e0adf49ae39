"""Compiling and loading the kernels: the Paddle extension (cpu_ops.cc, linear.cc) and the host library
(ngram.cc, plain C functions called through ctypes), and what the build target lets them use.

Each is built once per source version, flags, Paddle version and machine into <cache root>/kernels under a
file lock, so concurrent processes share one build; later processes load the built library directly. The build
target is EngineConfig.cpu_target (-march): `native` (this CPU), or another (e.g. x86-64-v3, an AVX2 CPU
without AVX-512, to build and test the paths such a machine takes). One process holds one build of the
extension: its operator names are global to Paddle.
"""
from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from specgen.errors import ConfigError

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = [HERE / "cpu_ops.cc", HERE / "linear.cc", HERE / "moe.cc", HERE / "sampling.cc"]
HEADERS = [HERE / "specgen_kernels.h"]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
HOST_SOURCE = HERE / "ngram.cc"
HOST_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
# CPU features the engine asks about, and the compiler macro that says a build may use them.
FEATURE_MACROS = {"avx512f": "__AVX512F__", "avx512_vnni": "__AVX512VNNI__", "avx2": "__AVX2__",
                  "fma": "__FMA__", "f16c": "__F16C__"}
BUILT_MARK = "built"  # written in a build directory once its library has been built and loaded

_ops: dict[str, ModuleType | None] = {}  # target -> the extension (None: not buildable here)
_host: dict[str, ctypes.CDLL | None] = {}
_macros: dict[str, str] = {}


def _compiler() -> str | None:
    return shutil.which("c++") or shutil.which("g++")


def _flags(base: list[str], target: str) -> list[str]:
    return [f"-march={target}" if f == "-march=native" else f for f in base]


def build_key(target: str = "native") -> str:
    """What the extension's build depends on: its sources, flags, Paddle's version and this machine."""
    import paddle

    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS)
                          + " ".join(_flags(FLAGS, target)).encode()
                          + paddle.__version__.encode() + platform.machine().encode()
                          + platform.node().encode()).hexdigest()[:16]


def build_dir(target: str, cache_root: Path) -> Path:
    return cache_root / "kernels" / build_key(target)


def ops(target: str, cache_root: Path) -> ModuleType | None:
    """The compiled operators for `target`, or None when they cannot be built here (no compiler, a build
    failure: logged once); callers then run the Paddle reference path."""
    if target not in _ops:
        loaded = [t for t, m in _ops.items() if m is not None]
        if loaded:
            raise ConfigError(f"the fused kernels were built for cpu_target {loaded[0]!r} in this process; "
                              f"one process cannot load them for {target!r} too")
        try:
            _ops[target] = _build(target, cache_root)
        except Exception as e:  # noqa: BLE001 - no compiler, missing headers, ...: the reference path runs instead
            log.warning("specgen: fused CPU kernels unavailable (%s); using the Paddle reference path",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            _ops[target] = None
    return _ops[target]


def _build(target: str, cache_root: Path) -> ModuleType | None:
    if _compiler() is None:
        return None
    from paddle.utils.cpp_extension import load

    d = build_dir(target, cache_root)
    built = load_built(d)
    if built is not None:
        return built
    d.mkdir(parents=True, exist_ok=True)
    with _locked(d):
        with _quiet(d / "build.log"):  # the builder prints to stdout/stderr even when nothing is rebuilt
            module = load(name="specgen_cpu_ops", sources=[str(p) for p in SOURCES],
                          extra_cxx_cflags=_flags(FLAGS, target), extra_ldflags=_openmp_ldflags(),
                          build_directory=str(d), verbose=False)
        (d / BUILT_MARK).touch()
        return module


def load_built(d: Path) -> ModuleType | None:
    """The operators of a finished build in d, loaded straight from its library: Paddle's `load` runs its
    setup.py in a subprocess at every start, even with nothing to rebuild (2.1-2.5 s of each `specgen`
    command). None when there is no finished build, or when this Paddle's loader is missing or fails (a
    private function of Paddle's: then `load` runs as before)."""
    lib = d / "specgen_cpu_ops"
    if not (d / BUILT_MARK).exists() or not (lib / "specgen_cpu_ops.so").exists():
        return None
    try:
        from paddle.utils.cpp_extension.extension_utils import _import_module_from_library

        with _quiet(d / "load.log"):  # Paddle logs "using custom operator only" to stderr
            return _import_module_from_library("specgen_cpu_ops", str(lib), False)
    except Exception as e:  # noqa: BLE001 - any failure here leaves the supported path, Paddle's builder
        log.info("specgen: loading the built kernels directly failed (%s); running Paddle's builder", e)
        return None


def _openmp_ldflags() -> list[str]:
    """Link against the OpenMP runtime Paddle already loads (Intel's libiomp5, which also serves GCC's GOMP
    entry points), so one thread pool serves both; two spinning pools would fight over the cores."""
    import paddle

    libs = Path(paddle.__file__).parent / "libs"
    if (libs / "libiomp5.so").exists():
        return [f"-L{libs}", "-l:libiomp5.so", f"-Wl,-rpath,{libs}"]
    return ["-fopenmp"]


def host(target: str, cache_root: Path) -> ctypes.CDLL | None:
    """ngram.cc as a shared library (plain C functions over int64 buffers), or None when it cannot be built
    (logged once); callers then use their numpy reference."""
    if target not in _host:
        try:
            _host[target] = _host_build(target, cache_root)
        except Exception as e:  # noqa: BLE001 - the numpy reference runs instead
            log.warning("specgen: host kernels unavailable (%s); using the numpy reference",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            _host[target] = None
    return _host[target]


def _host_build(target: str, cache_root: Path) -> ctypes.CDLL | None:
    cxx = _compiler()
    if cxx is None:
        return None
    flags = _flags(HOST_FLAGS, target)
    key = hashlib.sha256(HOST_SOURCE.read_bytes() + " ".join(flags).encode() + platform.machine().encode()
                         + platform.node().encode()).hexdigest()[:16]
    d = cache_root / "kernels" / f"host-{key}"
    d.mkdir(parents=True, exist_ok=True)
    lib = d / "libspecgen_host.so"
    with _locked(d):
        if not lib.exists():
            tmp = d / "libspecgen_host.so.tmp"
            r = subprocess.run([cxx, *flags, str(HOST_SOURCE), "-o", str(tmp)], capture_output=True,
                               text=True, check=False)
            (d / "build.log").write_text(r.stdout + r.stderr)
            if r.returncode != 0:
                raise RuntimeError(f"build failed; compiler output in {d / 'build.log'}")
            tmp.rename(lib)
    return ctypes.CDLL(str(lib))


@contextlib.contextmanager
def _locked(d: Path):
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet(log_path: Path):
    """Send file descriptors 1 and 2 (the compiler's and the builder's output) to `log_path` meanwhile; on
    failure the exception names the log."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(log_path, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        try:
            yield
        except Exception as e:
            raise RuntimeError(f"build failed ({type(e).__name__}); compiler output in {log_path}") from e
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])


def cpu_has(flag: str, target: str = "native") -> bool:
    """Whether this CPU has `flag` (a /proc/cpuinfo name, a key of FEATURE_MACROS) and the build target lets
    the kernels use it."""
    try:
        on_cpu = f" {flag} " in " " + Path("/proc/cpuinfo").read_text().replace("\n", " ") + " "
    except OSError:
        return False
    return on_cpu and (target == "native" or FEATURE_MACROS[flag] in _target_macros(target))


def _target_macros(target: str) -> str:
    """The compiler's predefined macros for -march=target (empty when there is no compiler or it refuses)."""
    if target not in _macros:
        cxx = _compiler()
        r = subprocess.run([cxx, f"-march={target}", "-dM", "-E", "-x", "c++", os.devnull],
                           capture_output=True, text=True, check=False) if cxx else None
        _macros[target] = r.stdout if r is not None and r.returncode == 0 else ""
    return _macros[target]


def packs(target: str = "native") -> bool:
    """Whether packed products pay on this CPU for this target: AVX-512, or AVX2 with FMA and F16C (elsewhere
    the kernels' generic product is only a reference, slower than MKL)."""
    return cpu_has("avx512f", target) or all(cpu_has(f, target) for f in ("avx2", "fma", "f16c"))


def has_vnni(target: str = "native") -> bool:
    """Whether the CPU has AVX-512 VNNI, which the integer products need to pay."""
    return cpu_has("avx512_vnni", target)
