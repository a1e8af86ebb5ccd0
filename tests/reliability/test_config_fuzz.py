"""Property test: whatever keys, values and YAML shapes a user gives, `posttrain explain` answers with a plan
(exit 0) or one error message (exit 2), never a traceback."""

from __future__ import annotations

import contextlib
import io
import math
import tempfile
import warnings
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from posttrain.cli import main
from posttrain.config.load import all_keys, field_info

KEYS = all_keys()
SECTIONS = sorted({k.rsplit(".", 1)[0] for k in KEYS if "." in k} | {k.split(".")[0] for k in KEYS})

# List-valued keys get their own share: their values go through a YAML parser.
LIST_KEYS = [k for k in KEYS if "list" in str(field_info(k)[1])]

keys = st.one_of(
    st.sampled_from(KEYS),
    st.sampled_from(LIST_KEYS),
    st.sampled_from(SECTIONS),
    st.sampled_from(KEYS).map(lambda k: k + ".x"),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz._ -", min_size=0, max_size=20),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**12), max_value=10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "[",
            "[0.9,",
            "]",
            "{a: 1}",
            "null",
            "-1",
            "0",
            "1e400",
            "[[1]]",
            "a,b",
            "nan",
            "~",
            "[a, {b: ]",
            "[0.9,1.0",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def _explain(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(err),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        try:
            code = main(["explain", "--json", *argv])
        except SystemExit as exc:
            code = exc.code  # argparse's own refusal (e.g. `-=x` reads as an option): exit 2, one message
    return code, err.getvalue()


def _text(value) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(keys, values), min_size=1, max_size=4))
def test_random_overrides_give_a_plan_or_one_message(pairs):
    argv = [f"{key}={_text(value)}" for key, value in pairs]
    code, err = _explain(argv)
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(values, st.dictionaries(keys, values, max_size=4)))
def test_random_yaml_shapes_give_a_plan_or_one_message(document):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.yaml"
        path.write_text(yaml.safe_dump(document))
        code, err = _explain([str(path)])
    assert code in (0, 2), (document, code, err)
    assert "Traceback" not in err
