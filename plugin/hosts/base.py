"""What every host adapter is: a name, the distribution it needs, a start-up check of the host
internals it touches, the config schema it accepts, and a way to serve a config."""

from __future__ import annotations

import importlib.metadata
import inspect

from expert_stream.streaming.errors import ExpertStreamError


class HostError(ExpertStreamError):
    """The host is missing, or is a version whose internals the adapter does not fit."""


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
