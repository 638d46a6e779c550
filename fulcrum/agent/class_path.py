"""A class by its dotted path, for the tool and interaction configs (each names its own errors)."""

from __future__ import annotations

import importlib
from typing import Any


def import_class(class_name: str, where: str, error: type[ValueError]) -> Any:
    """The attribute `Class` of module `package.module` named by `class_name`, or `error` naming `where`
    and what is missing (not a path, a module that does not import, no such attribute)."""
    module_name, _, attr = class_name.rpartition(".")
    if not module_name:
        raise error(f"{where}: {class_name!r} is not a class path (package.module.ClassName)")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise error(f"{where}: cannot import module {module_name!r} of {class_name}: {err}") from err
    found = getattr(module, attr, None)
    if found is None:
        raise error(f"{where}: module {module_name} has no {attr!r}")
    return found
