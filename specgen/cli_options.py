"""The run settings as command-line options, made from the config dataclasses (their fields' help and
defaults): every field of SamplingParams, EngineConfig and SpecConfig is a flag of `specgen run` and
`specgen bench`."""
from __future__ import annotations

import enum
import functools
import inspect
import typing
from typing import Annotated, Any, Callable

import typer

from specgen.app.settings import Setting, all_settings


def _annotation(s: Setting) -> Any:
    """Annotated[<type> | None, typer.Option(...)]: None means "not given" (the dataclasses hold the
    defaults)."""
    name = "--" + s.flag.replace("_", "-")
    default = s.default.value if isinstance(s.default, enum.Enum) else s.default
    shown = f" [default: {default}]" if default not in (None, "", ()) else ""
    t = s.type
    if t is bool:
        return Annotated[bool | None, typer.Option(f"{name}/--no-{name[2:]}", help=s.help + shown)]
    if typing.get_origin(t) is tuple:
        return Annotated[list[str] | None, typer.Option(name, help=s.help)]
    if typing.get_args(t) == (int, type(None)):
        t = int  # an optional count
    elif (isinstance(t, type) and issubclass(t, enum.Enum)
            or typing.get_origin(t) in (typing.Union, type(str | None))):
        t = str  # methods by name; an optional path
    return Annotated[t | None, typer.Option(name, help=s.help + shown)]


def with_settings(exclude: tuple[str, ...] = ()) -> Callable:
    """Add an option per setting (less `exclude`) to a command; the command receives them as `flags`
    ({Setting.flag: value or None})."""
    settings = [s for s in all_settings() if s.flag not in exclude]

    def decorate(command: Callable) -> Callable:
        sig = inspect.signature(command)
        hints = typing.get_type_hints(command, include_extras=True)  # the command's own options, resolved
        own = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()
               if p.name != "flags"]
        extra = [inspect.Parameter(s.flag, inspect.Parameter.KEYWORD_ONLY, default=None,
                                   annotation=_annotation(s))
                 for s in settings]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            flags = {s.flag: kwargs.pop(s.flag) for s in settings}
            return command(flags=flags, **kwargs)

        wrapper.__signature__ = sig.replace(parameters=own + extra)  # what typer reads
        wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
        return wrapper

    return decorate
