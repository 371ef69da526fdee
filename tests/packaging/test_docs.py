import os

import pytest

from kvobs import catalogue

DOCS = os.path.join(os.path.dirname(__file__), "..", "..", "docs")


@pytest.mark.parametrize("name", sorted(catalogue.GENERATED))
def test_generated_doc_is_fresh(name):
    with open(os.path.join(DOCS, name), encoding="utf-8") as handle:
        checked_in = handle.read()
    assert checked_in == catalogue.GENERATED[name](), (
        f"docs/{name} is stale: run `python -m kvobs.catalogue docs`")


def test_every_verdict_has_a_section():
    from kvobs.semconv import Verdict

    text = catalogue.verdicts_md()
    for verdict in Verdict:
        assert f"`{verdict.value}`" in text


def test_a_missing_docstring_is_named_not_a_type_error():
    def undocumented():
        pass

    with pytest.raises(ValueError, match="'undocumented' has no docstring"):
        catalogue._doc(undocumented)
