"""Backends: what runs a model's forward. `reference` (Paddle's operators, on any device Paddle runs on) and
`fused` (specgen's CPU kernels: the whole forward as one operator); selected from EngineConfig."""
from __future__ import annotations

import logging

import paddle

from specgen.backends.base import Backend, ForwardOutput, MtpPass
from specgen.config import EngineConfig
from specgen.errors import ConfigError

log = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    """auto: the GPU when Paddle is built with CUDA and one is visible, else the CPU."""
    has_gpu = paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0
    if device == "auto":
        return "gpu" if has_gpu else "cpu"
    if device == "gpu" and not has_gpu:
        raise ConfigError(
            "device gpu needs paddlepaddle-gpu and a visible CUDA GPU (this Paddle: "
            f"{'built with CUDA, no GPU visible' if paddle.is_compiled_with_cuda() else 'CPU build'})")
    return device


def select_backend(engine: EngineConfig) -> Backend:
    """The backend `engine` asks for, on its device (made Paddle's current device)."""
    from specgen import kernels
    from specgen.backends.reference import ReferenceBackend

    device = resolve_device(engine.device)
    paddle.set_device(device)
    # Paddle's math libraries and specgen's kernels share one OpenMP runtime: this sets both, in this process
    # (OMP_NUM_THREADS is left alone, so that workers of one machine can each take their share).
    paddle.base.core.set_num_threads(engine.num_threads())
    want = engine.backend
    if want == "fused" and device != "cpu":
        raise ConfigError(f"backend fused runs on the CPU (device {device}); use backend reference or auto")
    if want == "reference" or device != "cpu":
        return _reference(engine, ReferenceBackend)
    if want == "auto" and not kernels.packs(engine.cpu_target):
        # the kernels' products pay with AVX-512 or AVX2 + FMA + F16C; elsewhere MKL's (the reference) are
        # faster
        return _reference(engine, ReferenceBackend)
    ops = kernels.ops(engine.cpu_target, engine.cache_root())
    if ops is None:
        if want == "fused":
            raise ConfigError("backend fused needs specgen's CPU kernels, which could not be built here "
                              "(a C++ compiler is needed; see the log); use backend reference or auto")
        return _reference(engine, ReferenceBackend)
    from specgen.backends.fused import FusedBackend

    return FusedBackend(ops, engine)


def _reference(engine: EngineConfig, cls) -> Backend:
    if engine.matmul != "float32":
        raise ConfigError(f"matmul {engine.matmul} needs the fused backend (specgen's CPU kernels "
                          "on a CPU with AVX-512 VNNI)")
    return cls(engine)


__all__ = ["Backend", "ForwardOutput", "MtpPass", "select_backend", "resolve_device"]
