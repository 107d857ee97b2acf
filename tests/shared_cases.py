"""Reference cases with exact Gaussian inner products.

* The project's own cases, ``tests/reference_cases/gaussian_inner_products.json``, written by
  ``tests/reference_cases/generate.py`` (sympy expansion and Gaussian moments, independent of
  tensoralg and verify). They are always there: a plain clone runs the tests.
* The shared cases of ``../shared/cases`` (the folder beside the repository), checked too when
  the folder exists, under the names ``shared/<name>``; required when the environment variable
  ``CI`` is ``true`` (their absence then fails instead of passing silently).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

OWN_PATH = Path(__file__).resolve().parent / "reference_cases" / "gaussian_inner_products.json"
CASES_PATH = (Path(__file__).resolve().parents[2] / "shared" / "cases" /
              "gaussian_inner_products.json")


def load_cases() -> list[dict]:
    """Own cases (names as generated) followed by the shared ones (``shared/<name>``)."""
    if not OWN_PATH.exists():
        raise FileNotFoundError(f"{OWN_PATH}: missing; regenerate it with "
                                f"python tests/reference_cases/generate.py")
    cases = json.loads(OWN_PATH.read_text())
    if CASES_PATH.exists():
        cases += [{**c, "name": f"shared/{c['name']}"} for c in json.loads(CASES_PATH.read_text())]
    elif os.environ.get("CI", "").lower() == "true":
        raise FileNotFoundError(f"{CASES_PATH}: the shared reference cases are missing (required "
                                f"when CI=true; they sit in shared/ beside the repository)")
    return cases
