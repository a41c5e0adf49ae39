"""Fused CPU operators (cpu_ops.cc, linear.cc, sharing specgen_kernels.h), compiled on first use with Paddle's
C++ extension builder; and host functions on numpy buffers (ngram.cc: n-gram drafting), compiled on first use
into a plain shared library called through ctypes.

Built once per source version into ~/.cache/specgen/kernels (or $SPECGEN_CACHE/kernels) under a file lock, so
concurrent processes share one build. When no compiler is present, the build fails, the tensors are not on the
CPU, or SPECGEN_KERNELS=0, `ops()` returns None and the model runs its Paddle reference path
(specgen/engine/model.py), which computes the same functions op by op.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import numpy as np

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("cpu_ops.cc"), Path(__file__).with_name("linear.cc")]
HEADERS = [Path(__file__).with_name("specgen_kernels.h")]
FLAGS = ["-O3", "-march=native", "-fopenmp", "-std=c++17"]
HOST_SOURCE = Path(__file__).with_name("ngram.cc")
HOST_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]
# CPU features the engine asks about, and the compiler macro that says a build may use them.
FEATURE_MACROS = {"avx512f": "__AVX512F__", "avx512_vnni": "__AVX512VNNI__", "avx2": "__AVX2__", "fma": "__FMA__",
                  "f16c": "__F16C__"}
_state: dict[str, ModuleType | ctypes.CDLL | str | None] = {}


def switch(name: str) -> bool:
    """An on/off environment switch, on unless set to 0/false/no/off."""
    return os.environ.get(name, "1").lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    return switch("SPECGEN_KERNELS")


def march() -> str:
    """The target the kernels are built for: SPECGEN_MARCH (e.g. `x86-64-v3`, an AVX2 CPU without AVX-512, to
    build and test the paths such a machine takes), by default `native`, this CPU."""
    return os.environ.get("SPECGEN_MARCH", "native")


def _flags(base: list[str]) -> list[str]:
    return [f"-march={march()}" if f == "-march=native" else f for f in base]


def build_key() -> str:
    """What the kernels' build depends on: their sources, flags, Paddle's version and this machine."""
    import paddle

    return hashlib.sha256(b"".join(p.read_bytes() for p in SOURCES + HEADERS) + " ".join(_flags(FLAGS)).encode()
                          + paddle.__version__.encode() + platform.machine().encode()
                          + platform.node().encode()).hexdigest()[:16]


def _build_dir() -> Path:
    root = Path(os.environ.get("SPECGEN_CACHE", Path.home() / ".cache" / "specgen"))
    return root / "kernels" / build_key()


def _host_build() -> ctypes.CDLL | None:
    """ngram.cc as a shared library (no Paddle headers: plain C functions over int64 buffers)."""
    import fcntl
    import subprocess

    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return None
    key = hashlib.sha256(HOST_SOURCE.read_bytes() + " ".join(_flags(HOST_FLAGS)).encode() + platform.machine().encode()
                         + platform.node().encode()).hexdigest()[:16]
    d = Path(os.environ.get("SPECGEN_CACHE", Path.home() / ".cache" / "specgen")) / "kernels" / f"host-{key}"
    d.mkdir(parents=True, exist_ok=True)
    lib = d / "libspecgen_host.so"
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not lib.exists():
                tmp = d / "libspecgen_host.so.tmp"
                r = subprocess.run([cxx, *_flags(HOST_FLAGS), str(HOST_SOURCE), "-o", str(tmp)], capture_output=True,
                                   text=True, check=False)
                (d / "build.log").write_text(r.stdout + r.stderr)
                if r.returncode != 0:
                    raise RuntimeError(f"build failed; compiler output in {d / 'build.log'}")
                tmp.rename(lib)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    so = ctypes.CDLL(str(lib))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    so.specgen_ngram_match.argtypes = [ptr, i64, ptr, ptr, i64, i64, i64, i64, ptr, ptr, ptr]
    so.specgen_ngram_pool_lookup.argtypes = [ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64,
                                             ptr, ptr, ptr]
    so.specgen_ngram_propose.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, ptr, ptr, i64, i64,
                                         ptr, ptr, ctypes.c_double, ptr]
    so.specgen_ngram_match.restype = so.specgen_ngram_pool_lookup.restype = so.specgen_ngram_propose.restype = None
    return so


def host() -> ctypes.CDLL | None:
    """The host functions of ngram.cc, or None when disabled (SPECGEN_KERNELS=0) or not buildable (logged once);
    callers then use their numpy reference."""
    if not enabled():
        return None
    if "host" not in _state:
        try:
            _state["host"] = _host_build()
        except Exception as e:
            log.warning("specgen: host kernels unavailable (%s); using the numpy reference",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            _state["host"] = None
    return _state["host"]


def _openmp_ldflags() -> list[str]:
    """Link against the OpenMP runtime Paddle already loads (Intel's libiomp5, which also serves GCC's GOMP
    entry points), so one thread pool serves both; two spinning pools would fight over the cores."""
    import paddle

    libs = Path(paddle.__file__).parent / "libs"
    if (libs / "libiomp5.so").exists():
        return [f"-L{libs}", "-l:libiomp5.so", f"-Wl,-rpath,{libs}"]
    return ["-fopenmp"]


def _build() -> ModuleType | None:
    import fcntl

    import paddle

    if paddle.get_device() != "cpu" or shutil.which("c++") is None and shutil.which("g++") is None:
        return None
    from paddle.utils.cpp_extension import load

    d = _build_dir()
    built = _load_built(d)
    if built is not None:
        return built
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            with _quiet(d / "build.log"):  # the builder prints to stdout/stderr even when nothing is rebuilt
                module = load(name="specgen_cpu_ops", sources=[str(p) for p in SOURCES], extra_cxx_cflags=_flags(FLAGS),
                              extra_ldflags=_openmp_ldflags(), build_directory=str(d), verbose=False)
            (d / BUILT_MARK).touch()
            return module
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


BUILT_MARK = "built"  # written in a build directory once its library has been built and loaded


def _load_built(d: Path) -> ModuleType | None:
    """The operators of a finished build in d (its key covers the sources, flags, Paddle version and machine),
    loaded straight from its library: Paddle's `load` runs its setup.py in a subprocess at every start, even
    with nothing to rebuild (2.1-2.5 s of each `specgen` command). None when there is no finished build, or
    when this Paddle's loader is missing or fails (a private function of Paddle's: then `load` runs as before)."""
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


def ops() -> ModuleType | None:
    """The compiled operators, or None when they are disabled or cannot be built (logged once)."""
    if not enabled():
        return None
    if "ops" not in _state:
        try:
            _state["ops"] = _build()
        except Exception as e:  # no compiler, missing headers, ...: fall back to the reference path
            log.warning("specgen: fused CPU kernels unavailable (%s); using the Paddle reference path",
                        str(e).splitlines()[0] if str(e) else type(e).__name__)
            _state["ops"] = None
    return _state["ops"]


PANEL = 32  # output columns per panel of a packed weight (linear.cc)


def packed_linear_enabled(ops_module: ModuleType | None, dtype: str) -> bool:
    """Whether `Model` packs its float32 weights for specgen_linear: the kernels are built, the CPU has AVX-512 or
    AVX2 with FMA and F16C (elsewhere MKL's sgemm is kept: the generic fallback in linear.cc is only a reference)
    and SPECGEN_PACKED_LINEAR is not 0."""
    if ops_module is None or dtype != "float32" or not switch("SPECGEN_PACKED_LINEAR"):
        return False
    return _cpu_has("avx512f") or all(_cpu_has(f) for f in ("avx2", "fma", "f16c"))


def has_vnni() -> bool:
    """Whether the CPU has AVX-512 VNNI, which specgen_linear's integer products (int8_product) need to pay."""
    return _cpu_has("avx512_vnni")


def _cpu_has(flag: str) -> bool:
    """Whether this CPU has `flag` (a /proc/cpuinfo name, a key of FEATURE_MACROS) and the kernels' build
    target lets them use it (see march)."""
    try:
        on_cpu = f" {flag} " in " " + Path("/proc/cpuinfo").read_text().replace("\n", " ") + " "
    except OSError:
        return False
    return on_cpu and (march() == "native" or FEATURE_MACROS[flag] in _target_macros(march()))


def _target_macros(target: str) -> str:
    """The compiler's predefined macros for -march=target (empty when there is no compiler or it refuses)."""
    import subprocess

    key = f"macros:{target}"
    if key not in _state:
        cxx = shutil.which("c++") or shutil.which("g++")
        r = subprocess.run([cxx, f"-march={target}", "-dM", "-E", "-x", "c++", os.devnull], capture_output=True,
                           text=True, check=False) if cxx else None
        _state[key] = r.stdout if r is not None and r.returncode == 0 else ""
    return _state[key]


@dataclass
class Packed:
    """A weight W [k, n] for specgen_linear: float32 panels [ceil(n / 32), k, 32]; bfloat16 / float16 panels
    [ceil(n / 32), k / 32, 32 x 32] of a weight whose every value is one (see pack_linear); or block-quantized
    uint8 panels [ceil(n / 32), k / 32, QUANT_PANEL_BYTES[kind]] (see pack_quantized)."""

    panels: object  # paddle.Tensor
    k: int
    n: int
    kind: str = "F32"  # or one of HALF_KINDS, or a key of QUANT_PANEL_BYTES
    int8_product: bool = False  # quantized only: int8 panels, multiplied with the inputs quantized to int8

    def numpy(self) -> np.ndarray:
        """The dense [k, n] float32 weight (16-bit: widened; quantized: rebuilt as the GGUF reader does)."""
        p = self.panels.numpy()
        if self.int8_product:
            p = _dequantize_panels(_float_layout(p.view(np.uint8), self.kind), self.kind)
        elif self.kind in HALF_KINDS:
            wide = (p.astype(np.uint32) << 16).view(np.float32) if self.kind == "BF16" else p.astype(np.float32)
            p = wide.reshape(p.shape[0], self.k, PANEL)
        elif self.kind != "F32":
            p = _dequantize_panels(p, self.kind)  # [panels, k, 32]
        return np.ascontiguousarray(p.transpose(1, 0, 2).reshape(self.k, -1)[:, :self.n])

    def dense(self):
        import paddle

        return paddle.to_tensor(self.numpy())


# 16-bit panels: weights that are all exactly bfloat16 or float16 values (a bf16 / fp16 checkpoint, widened to
# float32 on load) are packed as such and widened exactly in registers, so a product reads half the bytes of the
# float32 panels and gives the same bits.
HALF_KINDS = ("BF16", "F16")


def half_kind(a: np.ndarray) -> str | None:
    """"BF16" when every float32 value of `a` is exactly a bfloat16, else "F16" when every one is exactly a
    float16 (bit for bit, so NaN payloads and -0 included), else None."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    if not (bits & 0xFFFF).any():
        return "BF16"
    with np.errstate(over="ignore"):
        back = a.astype(np.float16).astype(np.float32)
    return "F16" if np.array_equal(back.view(np.uint32), bits) else None


def pack_linear(w, halves: bool = True) -> Packed:
    """W [k, n] (a paddle tensor or array) -> Packed; zero columns pad n up to a multiple of 32. With `halves`,
    k a multiple of 32 and every weight exactly a bfloat16 (or float16), the panels hold those 16-bit values
    [panels, k / 32, 32 inputs x 32 columns] (HALF_KINDS); SPECGEN_HALF_WEIGHTS=0 keeps float32 panels."""
    import paddle

    a = np.asarray(w.numpy() if hasattr(w, "numpy") else w, dtype=np.float32)
    k, n = a.shape
    panels = -(-n // PANEL)
    if panels * PANEL != n:
        a = np.concatenate([a, np.zeros((k, panels * PANEL - n), a.dtype)], axis=1)
    p = np.ascontiguousarray(a.reshape(k, panels, PANEL).transpose(1, 0, 2))  # [panels, k, 32]
    kind = half_kind(a) if halves and k % 32 == 0 and switch("SPECGEN_HALF_WEIGHTS") else None
    if kind == "BF16":  # paddle takes uint16 arrays as bfloat16
        return Packed(paddle.to_tensor((p.view(np.uint32) >> 16).astype(np.uint16).reshape(panels, k // 32, -1)),
                      k, n, kind)
    if kind == "F16":
        return Packed(paddle.to_tensor(p.astype(np.float16).reshape(panels, k // 32, -1)), k, n, kind)
    return Packed(paddle.to_tensor(p), k, n)


# Bytes per panel (32 output columns) and block of 32 inputs in specgen_linear's quantized layout: the 32
# columns' fp16 scales d (Q4_1: then their fp16 minimums m), then the quants (Q8_0: 32 rows, one per input; Q4:
# nibbles grouped by 8 inputs, see _q4_lanes). K-quants' scales are float32: Q4_K d and -m (then nibbles),
# Q6_K d of inputs 0-15 and of inputs 16-31 (then q - 32 as int8, as Q8_0's), Q5_K as QX (see qx_rows and
# _pack_k_numpy).
QUANT_PANEL_BYTES = {"Q4_0": 64 + 512, "Q4_1": 128 + 512, "Q8_0": 64 + 1024, "Q4_K": 256 + 512, "Q6_K": 256 + 1024,
                     "QX": 512 + 1024, "Q5_K": 512 + 1024}  # QX: d of each half, m of each half, int8 quants
INT8_KINDS = ("Q4_0", "Q4_1", "Q8_0")  # kinds with integer products (int8_product)


def pack_quantized(kind: str, blocks: np.ndarray, int8_product: bool = False) -> Packed:
    """A GGUF block-quantized weight, uint8 blocks [n (out), k / 32, block bytes], -> Packed [k, n] for
    specgen_linear, which multiplies by it without dequantizing it in memory. Zero blocks pad n to a multiple of
    32 (d = m = 0: zero weights). With int8_product the quants are regrouped for integer products (linear.cc,
    "Integer products") and the panels are int8: specgen_linear then quantizes its inputs to int8 per block.

    GGUF blocks (gguf.quants): Q8_0 = d, 32 int8; Q4_0 = d, 16 bytes; Q4_1 = d, m, 16 bytes, where byte j holds
    input j in its low nibble and input j + 16 in its high one.
    """
    import paddle

    if kind not in QUANT_PANEL_BYTES:
        raise ValueError(f"unsupported quantization {kind!r}")
    if kind not in INT8_KINDS:  # K-quants: float32 products only
        return _pack_k_numpy(kind, blocks)
    k = ops()
    if k is not None:  # the same bytes in one C++ pass (numpy's below: ~0.5 s for the default model)
        panels, _ = k.specgen_pack_blocks(paddle.to_tensor(np.ascontiguousarray(blocks)), int8_product, False)
        return Packed(panels, blocks.shape[1] * 32, blocks.shape[0], kind, int8_product=int8_product)
    return _pack_quantized_numpy(kind, blocks, int8_product)


def _pack_quantized_numpy(kind: str, blocks: np.ndarray, int8_product: bool = False) -> Packed:
    """pack_quantized in numpy: the reference of specgen_pack_blocks (and the path without the kernels)."""
    import paddle

    n, kb, _ = blocks.shape
    panels = -(-n // PANEL)
    if panels * PANEL != n:
        blocks = np.concatenate([blocks, np.zeros((panels * PANEL - n, kb, blocks.shape[2]), np.uint8)])
    b = blocks.reshape(panels, PANEL, kb, -1).transpose(0, 2, 1, 3)  # [panels, kb, 32 columns, block bytes]
    parts = [b[..., 0:2].reshape(panels, kb, 64)]  # d of columns 0..31, fp16 little-endian
    if kind == "Q4_1":
        parts.append(b[..., 2:4].reshape(panels, kb, 64))  # m
    qs = b[..., 2 if kind != "Q4_1" else 4:]  # [panels, kb, 32 columns, 16 or 32 bytes]
    if int8_product:
        if kind == "Q8_0":  # unsigned q + 128
            u = (qs.view(np.int8).astype(np.int16) + 128).astype(np.uint8)  # [panels, kb, 32 columns, 32 inputs]
        else:
            u = np.concatenate([qs & 0xF, qs >> 4], axis=-1)
        # [panels, kb, column half h, column c, group g, input j] -> [.., g, h, c, j]
        u = u.reshape(panels, kb, 2, 16, 8, 4).transpose(0, 1, 4, 2, 3, 5)
        if kind != "Q8_0":  # columns c and c + 16 share a byte
            u = u[:, :, :, 0] | (u[:, :, :, 1] << 4)
        parts.append(u.reshape(panels, kb, -1))
        packed = np.ascontiguousarray(np.concatenate(parts, axis=-1)).view(np.int8)
        return Packed(paddle.to_tensor(packed), kb * 32, n, kind, int8_product=True)
    if kind == "Q8_0":
        parts.append(qs.transpose(0, 1, 3, 2).reshape(panels, kb, 1024))  # [input, column] int8
    else:
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).transpose(0, 1, 3, 2)  # [panels, kb, 32 inputs, 32 columns]
        parts.append(_q4_lanes(q))
    packed = np.ascontiguousarray(np.concatenate(parts, axis=-1))
    return Packed(paddle.to_tensor(packed), kb * 32, n, kind)


def block_parts(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks [n, k / block weights, block bytes] of `kind` -> per block of 32 inputs and half of it (inputs
    0-15, 16-31): scales d [n, k / 32, 2] and offsets m [n, k / 32, 2] (float32) and quants q [n, k / 32, 32]
    (int8), such that fma(d, q, m) rounds to exactly the weight gguf.quants dequantizes (its scale products,
    d * sc and dmin * m, are exact in float32; m is -0.0 where a format has no offset, so that a zero weight
    keeps the sign of d * q)."""
    from gguf.quants import Q4_K

    n, nb, _ = blocks.shape

    def f16(a: np.ndarray) -> np.ndarray:  # fp16 bytes [..., 2 j] -> float32 [..., j]
        return np.ascontiguousarray(a).view(np.float16).astype(np.float32)

    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        kb = nb
        d = np.repeat(f16(blocks[..., 0:2]), 2, axis=-1)  # [n, kb, 2]
        if kind == "Q8_0":
            q = blocks[..., 2:].view(np.int8)
        else:
            qs = blocks[..., 4 if kind == "Q4_1" else 2:]
            q = np.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(np.int8) - np.int8(8 if kind == "Q4_0" else 0)
        m = np.repeat(f16(blocks[..., 2:4]), 2, axis=-1) if kind == "Q4_1" else np.full((n, kb, 2), -0.0, np.float32)
        return d, m, q
    kb = nb * 8
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = f16(blocks[..., 0:2]), f16(blocks[..., 2:4])  # [n, nb, 1]
        sc, mn = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))  # [n nb, 8] each
        scale = (d * sc.reshape(n, nb, 8).astype(np.float32)).reshape(n, kb, 1)
        offset = -(dmin * mn.reshape(n, nb, 8).astype(np.float32)).reshape(n, kb, 1)
        if kind == "Q4_K":
            qs = blocks[..., 16:].reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
            q = (qs & 0xF).reshape(n, kb, 32)
        else:  # gguf.quants' Q5_K: 32 bytes of fifth bits, then nibbles
            qh, qs = blocks[..., 16:48], blocks[..., 48:]
            low = (qs.reshape(n, nb, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF
            high = (qh.reshape(n, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
            q = (low.reshape(n, nb, 8, 32) | (high << 4)).reshape(n, kb, 32)
        return np.repeat(scale, 2, axis=-1), np.repeat(offset, 2, axis=-1), q.astype(np.int8)
    if kind == "Q6_K":  # as gguf.quants dequantizes it: a scale per 16 inputs
        ql, qh = blocks[..., :128], blocks[..., 128:192]
        scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)  # [n, nb, 16]
        d = (f16(blocks[..., 208:210]) * scales).reshape(n, kb, 2)
        low = (ql.reshape(n, nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 0xF
        high = (qh.reshape(n, nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)) & 0x3
        q = (low.reshape(n, nb, 8, 32) | (high.reshape(n, nb, 8, 32) << 4)).astype(np.int8) - np.int8(32)
        return d, np.full((n, kb, 2), -0.0, np.float32), q.reshape(n, kb, 32)
    raise ValueError(f"no block parts for {kind!r}")


# Rows in specgen's own block format "QX" (QuantRows.blocks [n, k / 32, 48]): per 32 inputs d and m of each
# half as float32, then the 32 quants as int8, the union of the formats above (block_parts). Fused projections
# whose parts a GGUF stores in different formats (Q4_K_M: a Q6_K attn_v beside Q4_K attn_q and attn_k) are
# converted to it, as are Q5_K rows.


def qx_rows(kind: str, blocks: np.ndarray) -> np.ndarray:
    """GGUF blocks of `kind` -> QX blocks [n, k / 32, 48] uint8 with the same weights."""
    d, m, q = block_parts(kind, blocks)
    head = np.concatenate([d, m], axis=-1).astype(np.float32).view(np.uint8)  # [n, k / 32, 16]
    return np.ascontiguousarray(np.concatenate([head, q.view(np.uint8)], axis=-1))


def _pack_k_numpy(kind: str, blocks: np.ndarray) -> Packed:
    """GGUF Q4_K / Q6_K / Q5_K super-blocks, or QX rows, -> Packed [k, n] in blocks of 32 inputs (the layouts of
    QUANT_PANEL_BYTES; Q5_K as QX): each weight rebuilds to the value gguf.quants dequantizes."""
    import paddle

    if kind == "QX":
        head = blocks[..., :16].copy().view(np.float32)  # [n, kb, 4]: d of each half, then m
        d, m, q = head[..., :2], head[..., 2:], blocks[..., 16:].view(np.int8)
    else:
        d, m, q = block_parts(kind, blocks)
    n, kb, _ = q.shape
    if kind == "Q5_K":
        kind = "QX"
    panels = -(-n // PANEL)
    pad = panels * PANEL - n  # zero columns: zero scales, zero weights

    def by_panel(a: np.ndarray) -> np.ndarray:  # [n, kb, ...] -> [panels, kb, 32 columns, ...]
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)]) if pad else a
        return a.reshape(panels, PANEL, kb, *a.shape[2:]).swapaxes(1, 2)

    cols = by_panel(q).swapaxes(2, 3)  # [panels, kb, 32 inputs, 32 columns]
    if kind == "Q4_K":
        head, quants = [d[..., 0], m[..., 0]], _q4_lanes(cols.astype(np.uint8))
    elif kind == "Q6_K":
        head, quants = [d[..., 0], d[..., 1]], cols.reshape(panels, kb, 1024)
    else:  # QX
        head, quants = [d[..., 0], d[..., 1], m[..., 0], m[..., 1]], cols.reshape(panels, kb, 1024)
    head = [np.ascontiguousarray(by_panel(h), np.float32).view(np.uint8) for h in head]  # [panels, kb, 128] each
    packed = np.ascontiguousarray(np.concatenate(head + [np.ascontiguousarray(quants).view(np.uint8)], axis=-1))
    return Packed(paddle.to_tensor(packed), kb * 32, n, kind)


# Block kinds whose LM head specgen_forward can screen for greedy tokens (linear.cc, "Greedy tokens without the
# logits"): weights d * q, with no offset term, so the integer products' error has a bound per block.
SCREENED_KINDS = ("Q8_0", "Q4_0")


@dataclass
class Screen:
    """What specgen_forward needs to give a quantized LM head's greedy tokens without its logits: the same
    blocks as integer-product panels, and per panel, block of 32 inputs and column, |d| * sum |q| (float32
    [panels, k / 32, 32]; exact: an fp16 scale times an integer below 2^12)."""

    panels: Packed
    bound: object  # paddle.Tensor


def pack_screen(kind: str, blocks: np.ndarray) -> Screen:
    """A GGUF Q8_0 / Q4_0 weight, uint8 blocks [n (out), k / 32, block bytes] -> its Screen."""
    import paddle

    if kind not in SCREENED_KINDS:
        raise ValueError(f"no greedy screen for {kind!r} blocks (only {', '.join(SCREENED_KINDS)})")
    n, kb, _ = blocks.shape
    k = ops()
    if k is not None:  # panels and bound in one C++ pass (the numpy below: ~0.4 s for the default model's head)
        panels, bound = k.specgen_pack_blocks(paddle.to_tensor(np.ascontiguousarray(blocks)), True, True)
        return Screen(Packed(panels, kb * 32, n, kind, int8_product=True), bound.reshape([-1, kb, PANEL]))
    d = np.abs(np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32))  # [n, kb]
    byte = np.arange(256)
    if kind == "Q8_0":  # |q| of each quant byte (int8)
        table = np.abs(byte.astype(np.uint8).view(np.int8).astype(np.int32))
    else:  # |low nibble - 8| + |high nibble - 8|
        table = np.abs((byte & 0xF) - 8) + np.abs((byte >> 4) - 8)
    bound = d * table.astype(np.uint8)[blocks[..., 2:]].sum(-1, dtype=np.int32).astype(np.float32)  # [n, kb]
    panels = -(-n // PANEL)
    bound = np.concatenate([bound, np.zeros((panels * PANEL - n, kb), np.float32)])
    bound = np.ascontiguousarray(bound.reshape(panels, PANEL, kb).transpose(0, 2, 1))  # [panels, kb, 32]
    return Screen(pack_quantized(kind, blocks, int8_product=True), paddle.to_tensor(bound))


def _q4_lanes(q: np.ndarray) -> np.ndarray:
    """Nibbles [panels, kb, 32 inputs, 32 columns] -> the float32-product layout's 512 bytes per block: per group
    g of 8 inputs and half h of the columns, one little-endian 32-bit lane per column c, input 8g + j in its bits
    4j .. 4j + 3 (linear.cc, q4_nibble)."""
    panels, kb = q.shape[:2]
    q = q.reshape(panels, kb, 4, 8, 2, 16).transpose(0, 1, 2, 4, 5, 3)  # [.., g, h, c, j]
    return (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8).reshape(panels, kb, 512)


def _q4_nibbles(raw: np.ndarray) -> np.ndarray:
    """_q4_lanes' inverse: [panels, kb, 512] bytes -> nibbles [panels, kb, 32 inputs, 32 columns]."""
    panels, kb = raw.shape[:2]
    b = raw.reshape(panels, kb, 4, 2, 16, 4)  # [.., g, h, c, byte]
    q = np.stack([b & 0xF, b >> 4], axis=-1).reshape(panels, kb, 4, 2, 16, 8)  # [.., g, h, c, j]
    return q.transpose(0, 1, 2, 5, 3, 4).reshape(panels, kb, 32, 32)


def _float_layout(p: np.ndarray, kind: str) -> np.ndarray:
    """Integer-product panels (as uint8) -> the same weights in the float32-product layout."""
    panels, kb, _ = p.shape
    head = p[..., :128 if kind == "Q4_1" else 64]
    if kind == "Q8_0":
        u = p[..., 64:].reshape(panels, kb, 8, 2, 16, 4)  # [.., g, h, c, j]
        q = (u.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
        q = q.transpose(0, 1, 2, 5, 3, 4).reshape(panels, kb, 1024)  # [.., input 4g + j, column 16h + c]
        return np.concatenate([head, q], axis=-1)
    raw = p[..., -512:].reshape(panels, kb, 8, 16, 4)  # [.., g, c, j]
    q = np.stack([raw & 0xF, raw >> 4], axis=3)  # [.., g, h, c, j]
    q = q.transpose(0, 1, 2, 5, 3, 4).reshape(panels, kb, 32, 32)  # [.., input 4g + j, column 16h + c]
    return np.concatenate([head, _q4_lanes(q)], axis=-1)


def _dequantize_panels(p: np.ndarray, kind: str) -> np.ndarray:
    """uint8 panels [panels, k / 32, bytes] -> float32 [panels, k, 32], with gguf.quants' float32 arithmetic."""
    panels, kb, _ = p.shape
    if kind == "QX":  # w = d q + m per half, d q exact
        d0, d1, m0, m1 = (p[..., a:a + 128].copy().view(np.float32)[:, :, None, :] for a in (0, 128, 256, 384))
        q = p[..., 512:].copy().view(np.int8).reshape(panels, kb, 32, 32).astype(np.float32)
        w = np.concatenate([q[:, :, :16] * d0 + m0, q[:, :, 16:] * d1 + m1], axis=2)
        return w.reshape(panels, kb * 32, PANEL)
    if kind in ("Q4_K", "Q6_K"):  # float32 scales [panels, kb, 1, 32] x 2
        d, e = (p[..., a:a + 128].copy().view(np.float32)[:, :, None, :] for a in (0, 128))
        if kind == "Q4_K":
            w = d * _q4_nibbles(p[..., -512:]).astype(np.float32) + e  # e = -(dmin * m)
        else:
            q = p[..., 256:].copy().view(np.int8).reshape(panels, kb, 32, 32).astype(np.float32)
            w = q * np.concatenate([np.broadcast_to(d, (panels, kb, 16, 32)), np.broadcast_to(e, (panels, kb, 16, 32))],
                                   axis=2)
        return w.reshape(panels, kb * 32, PANEL)
    d = p[..., :64].copy().view(np.float16).astype(np.float32)[:, :, None, :]  # [panels, kb, 1, 32]
    if kind == "Q8_0":
        q = p[..., 64:].copy().view(np.int8).reshape(panels, kb, 32, 32).astype(np.float32)
        w = q * d
    else:
        q = _q4_nibbles(p[..., -512:]).astype(np.float32)  # [panels, kb, 32 inputs, 32 columns]
        if kind == "Q4_0":
            w = d * (q - np.float32(8))
        else:
            m = p[..., 64:128].copy().view(np.float16).astype(np.float32)[:, :, None, :]
            w = d * q + m
    return w.reshape(panels, kb * 32, PANEL)


def dense(w):
    """A weight as a dense paddle tensor [k, n], whether or not it is packed."""
    return w.dense() if isinstance(w, Packed) else w


def argmax(x):
    """Index of the largest value in each row of x [rows, vocab]: int64 [rows], the lowest index on a tie (as
    paddle.argmax); the fused op when the kernels are built and x is on the CPU."""
    import paddle

    k = ops()
    if k is None or not x.place.is_cpu_place():
        return paddle.argmax(x, axis=-1)
    out = k.specgen_argmax(x)
    return out[0] if isinstance(out, (list, tuple)) else out
