"""specgen: offline batch generation with lossless speculative decoding, on PaddlePaddle."""
from __future__ import annotations

import os as _os

# Paddle pins OMP_NUM_THREADS=1 at import when it is unset; give it the cores we have instead.
if "OMP_NUM_THREADS" not in _os.environ:
    from specgen.config import default_threads as _dt

    _os.environ["OMP_NUM_THREADS"] = str(_dt())

import contextlib as _contextlib  # noqa: E402
import io as _io  # noqa: E402
import warnings as _warnings  # noqa: E402

# Paddle prints a multi-thread banner to stderr at import whenever OMP_NUM_THREADS > 1, and warns about ccache;
# neither concerns a specgen user, so the import runs with both silenced.
_warnings.filterwarnings("ignore", message="No ccache found")
with _contextlib.redirect_stderr(_io.StringIO()):
    import paddle as _paddle  # noqa: E402,F401

from specgen.api import LoadedModel, generate, load_model  # noqa: E402
from specgen.config import EngineConfig, Method, SamplingParams, SpecConfig  # noqa: E402

__version__ = "0.1.0"
__all__ = ["generate", "load_model", "LoadedModel", "SamplingParams", "EngineConfig", "SpecConfig", "Method",
           "__version__"]
