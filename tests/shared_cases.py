"""The reference cases of ``../shared/cases`` (the shared folder sits beside the repository,
in CI as on a developer's machine). Missing cases are an error, never a skip: the exactness
tests must not pass silently without their reference values."""

from __future__ import annotations

import json
from pathlib import Path

CASES_PATH = (Path(__file__).resolve().parents[2] / "shared" / "cases" /
              "gaussian_inner_products.json")


def load_cases() -> list[dict]:
    if not CASES_PATH.exists():
        raise FileNotFoundError(f"{CASES_PATH}: the shared reference cases are missing; the "
                                f"tests expect the shared/ folder beside the repository")
    return json.loads(CASES_PATH.read_text())
