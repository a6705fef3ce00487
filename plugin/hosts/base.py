"""What every host adapter is (`HostAdapter`): a name, the distribution it needs, a start-up
check of the host internals it touches, the config schema it accepts, and a way to serve a
config. Plus the small helpers the adapters' checks share."""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any, Optional, Protocol, runtime_checkable

from expert_stream.streaming.errors import ExpertStreamError


class HostError(ExpertStreamError):
    """The host is missing, or is a version whose internals the adapter does not fit."""


@runtime_checkable
class HostAdapter(Protocol):
    """What `register_hosts` registers, and all the CLI and the plugin core call on a host.

    `internals()` is the start-up check: it imports the host and checks every internal the
    adapter touches (each host wing's `compat.py`), raising HostError that names the host
    version and each internal that does not fit. `schema()` and `load_config()` take its
    result so a caller that has it does not check twice; `serve()` checks first, then runs
    the host in this process until it exits and returns its exit code."""

    name: str  # the key in `plugins.hosts()`
    distribution: str  # the installed distribution whose version is checked
    install_hint: str  # what to run when it is missing

    def version(self) -> str: ...

    def internals(self) -> Any: ...

    def schema(self, internals: Optional[Any] = None): ...  # -> config.HostSchema

    def load_config(self, path, internals: Optional[Any] = None, **kw): ...  # -> config.HostConfig

    def serve(self, config_path: str, host_args: list[str]) -> int: ...


def installed_version(distribution: str, install_hint: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        raise HostError(f"{distribution} is not installed: {install_hint}") from None


def refuse(host: str, version: str, problems: list[str]) -> None:
    """Raise one error listing every internal that does not fit."""
    if problems:
        raise HostError(
            f"{host} {version} is not supported by expert-stream: "
            + "; ".join(problems)
            + ". Install a supported version (see `expert-stream serve --help`)."
        )


def parameter_names(fn) -> list[str]:
    """The parameter names of a host function, or [] when it is missing or not inspectable:
    the adapters compare them with what they were written against."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def source(fn) -> str:
    """The source of a host function ("" when unavailable): the checks look for the private
    attributes its __init__ sets."""
    try:
        return inspect.getsource(fn)
    except (TypeError, OSError):
        return ""
