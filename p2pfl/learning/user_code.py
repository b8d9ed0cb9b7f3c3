"""A user's own code, named in a topology as ``package.module:attribute`` (a dataset function,
a model factory).

Contract: :func:`import_object` imports the module and returns the attribute, or raises
:class:`UserCodeError` whose message names the path and what failed (the module is not
found, it raised while importing, the attribute is missing or not callable). The module is
looked for in the folder of the topology that names it (``code_dir``, put first on the
import path by the loader: :func:`p2pfl.config.paths.use_code_dir`), then in the current
directory, as for ``python -m`` (the launcher's node processes start in the launcher's),
then in the installed packages.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

from p2pfl.config.paths import code_dirs
from p2pfl.errors import P2PFLError


class UserCodeError(P2PFLError, ImportError):
    """A user's ``package.module:attribute`` that cannot be imported or used."""


def _where(exc: BaseException) -> str:
    """`` (file:line)`` of the innermost frame of ``exc`` in the user's code (not in p2pfl,
    torch or another installed package); empty when none is."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    here = os.path.dirname(os.path.abspath(__file__))
    package_root = os.path.dirname(here)

    def theirs(path: str) -> bool:
        return "site-packages" not in path and not path.startswith(package_root)

    frame = next((f for f in reversed(frames) if theirs(f.filename)), None)
    return f" ({frame.filename}:{frame.lineno})" if frame else ""


def describe(exc: BaseException) -> str:
    """``Type: message (file:line)``: a user exception in one line, for error messages."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}{': ' + text if text else ''}{_where(exc)}"


def import_object(path: str, what: str = "object") -> Any:
    """The attribute ``path`` names (``package.module:attribute``, dotted attributes
    allowed), which must be callable. ``what`` says what it is for the message
    (``"model factory"``)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UserCodeError(f"{what} {path!r}: expected 'package.module:attribute'")
    cwd = os.getcwd()
    folders = code_dirs()
    if cwd not in sys.path and "" not in sys.path:  # after the topologies' folders
        present = [sys.path.index(f) for f in folders if f in sys.path]
        sys.path.insert(max(present) + 1 if present else 0, cwd)
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name):
            where = "".join(f"{f} (the topology's folder), " for f in folders[:1] if f != cwd)
            raise UserCodeError(
                f"{what} {path!r}: no module named {exc.name!r} (looked in {where}the "
                f"current directory {cwd} and the installed packages)"
            ) from None
        raise UserCodeError(f"{what} {path!r}: importing it failed: {describe(exc)}") from None
    except Exception as exc:  # the user's module raised while importing
        raise UserCodeError(f"{what} {path!r}: importing it failed: {describe(exc)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UserCodeError(f"{what} {path!r}: module {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UserCodeError(f"{what} {path!r}: {attr!r} is not callable")
    return obj
