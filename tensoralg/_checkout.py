"""``tensoralg.verify`` in a source checkout that is not installed.

``pyproject.toml`` installs the repository's top-level ``verify/`` folder as the subpackage
``tensoralg.verify`` (a wheel holds it at ``tensoralg/verify/``; an editable install maps the
name to the folder). Run from a checkout without installing it (``PYTHONPATH=.``), or with an
editable install made before that mapping existed, nothing maps the name: `install` then
appends a finder to `sys.meta_path` that resolves exactly ``tensoralg.verify`` to the
checkout's ``verify/`` folder (its submodules follow from the package's ``__path__``). It does
nothing when ``tensoralg/verify/`` exists (a wheel install) or the checkout has no ``verify/``.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys

_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_FOLDER = os.path.join(os.path.dirname(_PACKAGE), "verify")


class _CheckoutVerifyFinder(importlib.abc.MetaPathFinder):
    """Finds ``tensoralg.verify`` in the checkout's ``verify/`` folder (and nothing else)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "tensoralg.verify":
            return None
        return importlib.util.spec_from_file_location(
            fullname, os.path.join(_FOLDER, "__init__.py"), submodule_search_locations=[_FOLDER])


def install() -> None:
    if os.path.isdir(os.path.join(_PACKAGE, "verify")):
        return   # installed from a wheel: tensoralg/verify/ is a plain subpackage
    if not os.path.isfile(os.path.join(_FOLDER, "__init__.py")):
        return
    if not any(isinstance(f, _CheckoutVerifyFinder) for f in sys.meta_path):
        sys.meta_path.append(_CheckoutVerifyFinder())   # after any installed finder
