"""The one error hierarchy; the CLI maps each class to an exit code."""


class SpecgenError(Exception):
    """Base of every error specgen raises on purpose."""

    exit_code = 1


class ConfigError(SpecgenError):
    """A bad option, YAML key or contradictory setting."""

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
