"""The one error hierarchy; the CLI maps each class to an exit code (README: "Exit codes")."""

# A run that wrote every record but some of them are error records (bad input, non-finite numbers).
EXIT_RECORD_ERRORS = 8
EXIT_SIGINT = 130
EXIT_SIGTERM = 143


class SpecgenError(Exception):
    """Base of every error specgen raises on purpose."""

    exit_code = 1


class ConfigError(SpecgenError):
    """A bad option, YAML key or contradictory setting (or a resume whose settings differ from the
    output's)."""

    exit_code = 2


class InputError(SpecgenError):
    """A bad input file or record (names the line and the field)."""

    exit_code = 2


class CheckpointError(SpecgenError):
    """A missing, unsupported or malformed checkpoint (names the file and tensor)."""

    exit_code = 3


class EngineError(SpecgenError):
    """An internal invariant of the engine failed at run time."""

    exit_code = 4


class WorkerError(EngineError):
    """A worker process of a parallel job died (killed, out of memory) or stopped answering; the records
    finished before are in the output and --resume completes it."""


class OutputError(SpecgenError):
    """The output could not be written (disk full, I/O error, folder gone, read-only); what was written before
    is intact and --resume completes it."""

    exit_code = 5


class OutputBusyError(SpecgenError):
    """Another run holds the output's lock."""

    exit_code = 6


class MemoryBudgetError(SpecgenError):
    """The KV cache at the configured batch size and context does not fit the memory available."""

    exit_code = 7


class Stopped(BaseException):
    """SIGTERM or SIGINT asked the run to stop; finished records are written. A BaseException, as
    KeyboardInterrupt is: no `except Exception` on the way (a loader's, a kernel build's) may swallow the
    stop."""

    def __init__(self, signum: int, detail: str | None = None):
        import signal

        name = signal.Signals(signum).name
        super().__init__(f"stopped by {name}" + (f": {detail}" if detail else ""))
        self.signum = signum
        self.exit_code = EXIT_SIGTERM if signum == signal.SIGTERM else EXIT_SIGINT
