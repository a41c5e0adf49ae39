"""specgen: offline batch generation with lossless speculative decoding, on PaddlePaddle."""
from __future__ import annotations

import contextlib as _contextlib
import io as _io
import signal as _signal
import warnings as _warnings

# Paddle prints a multi-thread banner to stderr at import when OMP_NUM_THREADS > 1, and warns about ccache;
# neither concerns a specgen user, so the import runs with both silenced. Threads are set when a model loads
# (EngineConfig.threads), not through the environment.
_warnings.filterwarnings("ignore", message="No ccache found")
# Paddle's signal handlers turn a scheduler's SIGTERM into a C++ crash dump; specgen's job stops on it cleanly
# (specgen/app/job.py), so they are turned off as soon as Paddle is in, and a SIGTERM that comes while Paddle
# is being imported waits until then (it then ends the process quietly: nothing was written yet).
_held = None
if hasattr(_signal, "pthread_sigmask"):
    _held = _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGTERM})
try:
    with _contextlib.redirect_stderr(_io.StringIO()):
        import paddle as _paddle
    _paddle.disable_signal_handler()
finally:
    if _held is not None:
        _signal.pthread_sigmask(_signal.SIG_SETMASK, _held)

from specgen.api import LoadedModel, generate, load_model  # noqa: E402
from specgen.config import (  # noqa: E402
    DraftConfig,
    EngineConfig,
    Method,
    MtpConfig,
    NgramConfig,
    SamplingParams,
    SpecConfig,
)

__version__ = "0.1.0"
__all__ = ["generate", "load_model", "LoadedModel", "SamplingParams", "EngineConfig", "SpecConfig",
           "NgramConfig", "MtpConfig", "DraftConfig", "Method", "__version__"]
