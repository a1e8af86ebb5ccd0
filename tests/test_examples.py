"""Every example config loads against the schema and yields a valid batch plan."""

from pathlib import Path

import pytest

from posttrain.config.load import build_config
from posttrain.config.plan import build_plan

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_examples_exist():
    assert EXAMPLES


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_is_valid(path):
    build_plan(build_config([path]))
