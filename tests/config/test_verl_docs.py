"""docs/migrating-from-verl.md holds the translation table exactly as the code generates it."""

from pathlib import Path

from posttrain.config.verl_keys import translation_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "migrating-from-verl.md"


def test_translation_table_in_docs_is_current():
    text = DOC.read_text()
    table = text.split("<!-- translation table: begin -->\n", 1)[1].split(
        "<!-- translation table: end -->", 1
    )[0]
    assert table == translation_markdown(), (
        "regenerate the table: python3 -m posttrain.config.verl_keys, between the markers in " + DOC.name
    )
