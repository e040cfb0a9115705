"""Nothing the tinker SDK sends is dropped without a word: every field of every request type in the
real tinker 0.38 SDK's ``tinker.types`` is honoured or refused (:mod:`sess.engine.server.tinker.fields`),
the check fails for a field in neither set (one removed from both, or one a later SDK adds), and
docs/tinker.md's tables (fields, and the clients' public methods) are the modules'. The walk of the SDK's types runs in its own venv (slow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.server.tinker import fields, methods

from tinker_helpers import make_tinker_venv, run_client

DOC = Path(__file__).resolve().parents[2] / "docs" / "tinker.md"
TABLES = {"honoured": fields.HONOURED, "refused": fields.REFUSED, "undecided": fields.UNDECIDED}


@pytest.fixture(scope="module")
def sdk(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tinker-fields")
    python = make_tinker_venv(root)
    spec = {"out": str(root / "fields.json")}
    return run_client(python, "fields.py", spec, url="http://127.0.0.1:9", key="tml-unused")


@pytest.fixture(scope="module")
def sdk_fields(sdk) -> dict[str, list[str]]:
    return sdk["types"]


@pytest.mark.parametrize("table, module", [("fields", fields), ("methods", methods)])
def test_docs_tables_are_the_modules(table, module):
    text = DOC.read_text()
    start = text.index("\n", text.index(f"<!-- {table} table:")) + 1
    end = text.index(f"<!-- end of {table} table -->")
    assert text[start:end].strip() == module.markdown_table()


@pytest.mark.slow
def test_every_public_method_of_the_sdk_clients_is_listed(sdk):
    assert (
        "SamplingClient.sample" in sdk["methods"]
        and "RestClient.publish_checkpoint_from_tinker_path" in sdk["methods"]
    )
    assert [m for m in sdk["methods"] if methods.status(m) is None] == []
    assert [m for m in methods.METHODS if m not in sdk["methods"]] == []


def test_a_field_is_in_one_table_and_every_refusal_has_a_reason():
    for a, first in TABLES.items():
        for b, second in TABLES.items():
            if a < b:
                both = [(n, f) for n in first for f in first[n] if f in second.get(n, {})]
                assert both == [], (a, b)
    assert all(reason.strip() for table in fields.REFUSED.values() for reason in table.values())


def test_a_refused_field_set_is_a_400_naming_it_with_the_reason():
    fields.check_refused("SaveWeightsExternalRequest", {"age_encryption_recipients": None})
    with pytest.raises(InvalidRequest, match="age_encryption_recipients: .*export unencrypted"):
        fields.check_refused("SaveWeightsExternalRequest", {"age_encryption_recipients": ["age1x"]})
    with pytest.raises(InvalidRequest, match="new_option: not a field of SampleRequest"):
        fields.check_known("SampleRequest", {"prompt": {}, "new_option": 1})


@pytest.mark.slow
def test_every_field_of_every_sdk_request_is_honoured_or_refused(sdk_fields):
    assert "SampleRequest" in sdk_fields and "record_stability_info" in sdk_fields["SampleRequest"]
    assert "DimuonParams" in sdk_fields and "ImageAssetPointerChunk" in sdk_fields  # reached by the walk
    assert fields.uncovered(sdk_fields) == []
    stale = [
        f"{name}.{field}"
        for table in TABLES.values()
        for name, entries in table.items()
        for field in entries
        if field not in sdk_fields.get(name, [])
    ]
    assert stale == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, field",
    [
        ("SampleRequest", "record_stability_info"),
        ("SampleRequest", "topk_sample_logprobs"),
        ("Datum", "model_input_spans"),
    ],
)
def test_the_check_fails_for_a_field_removed_from_both_sets(sdk_fields, name, field):
    honoured = {
        n: {f: v for f, v in t.items() if (n, f) != (name, field)} for n, t in fields.HONOURED.items()
    }
    refused = {n: {f: v for f, v in t.items() if (n, f) != (name, field)} for n, t in fields.REFUSED.items()}
    assert fields.uncovered(sdk_fields, honoured, refused) == [f"{name}.{field}"]
    grown = {**sdk_fields, "SampleRequest": [*sdk_fields["SampleRequest"], "a_later_option"]}
    assert fields.uncovered(grown) == ["SampleRequest.a_later_option"]


def test_no_field_is_dropped_without_a_word():
    assert fields.UNDECIDED == {}
