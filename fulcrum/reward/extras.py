"""Optional dependencies of the scorers: import one, or fail with one line naming the extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(ImportError):
    """A scorer needs a package of an optional extra that is not installed."""


def need(module: str, extra: str, what: str) -> ModuleType:
    """Import `module`, or raise MissingExtra: "<what> needs <module>: pip install 'fulcrum[<extra>]'"."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise MissingExtra(
            f"{what} needs the package {module.split('.')[0]!r}, which is not installed: "
            f"pip install 'fulcrum[{extra}]'"
        ) from err
