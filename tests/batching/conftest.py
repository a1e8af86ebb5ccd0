"""Fixtures for the batching tests."""

import importlib.util
import sys
from pathlib import Path

import pytest

_REF = Path(__file__).resolve().parents[2] / "benchmarks" / "verl_reference.py"


@pytest.fixture(scope="session")
def verl_reference():
    """The benchmark-only reproduction of verl's balancing, to compare against."""
    spec = importlib.util.spec_from_file_location("verl_reference", _REF)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
