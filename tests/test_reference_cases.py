"""The project's reference cases are what their generator computes (a stale JSON fails), and the
shared folder is found when present."""

import json
import os
import sys

import pytest
from shared_cases import CASES_PATH, OWN_PATH, load_cases


def test_own_cases_match_their_generator():
    sys.path.insert(0, str(OWN_PATH.parent))
    try:
        import generate
    finally:
        sys.path.pop(0)
    fresh = generate.cases()
    stored = json.loads(OWN_PATH.read_text())
    assert fresh == stored


def test_shared_cases_are_loaded_when_present_and_required_in_ci():
    names = [c["name"] for c in load_cases()]
    assert "one_plus_x_squared" in names and "reparam_depth2_identical" in names
    if CASES_PATH.exists():
        assert any(n.startswith("shared/") for n in names)
    elif os.environ.get("CI", "").lower() == "true":  # pragma: no cover - load_cases raised
        pytest.fail("shared cases missing in CI")


def test_plain_clone_without_shared(monkeypatch, tmp_path):
    import shared_cases

    monkeypatch.setattr(shared_cases, "CASES_PATH", tmp_path / "nope.json")
    monkeypatch.delenv("CI", raising=False)
    assert [c["name"] for c in shared_cases.load_cases()] == [
        c["name"] for c in json.loads(OWN_PATH.read_text())]
    monkeypatch.setenv("CI", "true")
    with pytest.raises(FileNotFoundError, match="CI=true"):
        shared_cases.load_cases()
