"""Checkpoint loading: HF directories, GGUF files, and the built-in default model."""
from __future__ import annotations

from pathlib import Path

from specgen.errors import CheckpointError
from specgen.models.checkpoint import Checkpoint


def load_checkpoint(path: str | Path | None, cache_root: Path | None = None,
                    quantization: str = "auto") -> Checkpoint:
    """Load an HF directory or a .gguf file; None means the default SmolLM2-135M-Instruct. A GGUF file is
    converted once into `cache_root` (default: EngineConfig().cache_root()) and read back from there; so is a
    checkpoint quantized at load (`quantization`: specgen/models/quantize.py)."""
    if cache_root is None:
        from specgen.config import EngineConfig

        cache_root = EngineConfig().cache_root()
    if quantization != "auto":
        from specgen.models.quantize import load_quantized

        source = path
        if source is None:
            from specgen.models import default_model

            source = default_model.default_gguf_path()
        _check_exists(Path(source))
        return load_quantized(str(source), quantization, cache_root,
                              lambda: load_checkpoint(path, cache_root))
    from specgen.models import hf_loader

    if path is None or Path(path).suffix == ".gguf":
        from specgen.models import default_model
    if path is None:
        return default_model.load_cached(default_model.default_gguf_path(), cache_root)
    p = Path(path)
    _check_exists(p)
    if p.is_dir():
        return hf_loader.load_hf_dir(p)
    return default_model.load_cached(p, cache_root)


def _check_exists(p: Path) -> None:
    if p.is_dir():
        return
    if p.suffix == ".gguf":
        if not p.exists():
            raise CheckpointError(f"{p}: file not found")
        return
    if not p.exists():
        raise CheckpointError(f"{p}: no such checkpoint (give an HF directory or a .gguf file)")
    raise CheckpointError(f"{p}: not a checkpoint (give an HF directory or a .gguf file)")


__all__ = ["Checkpoint", "load_checkpoint"]
