"""Marks shared by the test modules (the hook that applies them is in tests/conftest.py)."""

from __future__ import annotations


def slow_fixture(fixture_function):
    """Mark a fixture that trains or starts processes: every test using it (directly or through
    another fixture) is ``slow`` too, so ``pytest -m "not slow"`` never pays its set-up. Put it
    below ``@pytest.fixture``."""
    fixture_function.smelt_slow = True
    return fixture_function
