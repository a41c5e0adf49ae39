"""specgen's kernels: fused CPU operators (cpu_ops.cc, linear.cc, sharing specgen_kernels.h) compiled with
Paddle's C++ extension builder, and host functions on numpy buffers (ngram.cc) called through ctypes.

build.py compiles and loads them, packing.py lays out weights for them, args.py and host.py hold the typed
arguments each one is called with. When they cannot be built (no compiler) the engine runs the Paddle
reference backend and the numpy references, which compute the same functions.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from types import ModuleType

from specgen.kernels import build
from specgen.kernels.build import has_vnni, packs
from specgen.kernels.packing import (
    HALF_KINDS,
    INT8_KINDS,
    PANEL,
    QUANT_PANEL_BYTES,
    SCREENED_KINDS,
    Packed,
    Screen,
    block_parts,
    dense,
    half_kind,
    pack_linear,
    pack_parts,
    pack_quantized,
    pack_screen,
    qx_rows,
)


def ops(target: str = "native", cache_root: Path | None = None) -> ModuleType | None:
    """The fused operators built for `target` (EngineConfig.cpu_target), or None where they cannot be
    built."""
    return build.ops(target, cache_root or _default_root())


def host_lib(target: str = "native", cache_root: Path | None = None) -> ctypes.CDLL | None:
    """ngram.cc's library with its argument types declared, or None where it cannot be built."""
    from specgen.kernels.host import declare

    lib = build.host(target, cache_root or _default_root())
    return declare(lib) if lib is not None else None


def _default_root() -> Path:
    from specgen.config import EngineConfig

    return EngineConfig().cache_root()


__all__ = ["ops", "host_lib", "has_vnni", "packs", "Packed", "Screen", "PANEL", "HALF_KINDS", "INT8_KINDS",
           "QUANT_PANEL_BYTES", "SCREENED_KINDS", "block_parts", "dense", "half_kind", "pack_linear",
           "pack_parts", "pack_quantized", "pack_screen", "qx_rows"]
