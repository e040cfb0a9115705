"""Nothing an OpenAI client sends is dropped without a word: every field of the installed ``openai``
package's completions and chat completions request types is honoured or refused
(:mod:`sess.engine.server.openai.fields`), the walk fails for a field in neither table (its probe
removes one from both), and docs/openai.md's tables are the module's."""

from __future__ import annotations

from pathlib import Path

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from sess.engine.protocol.errors import InvalidRequest
from sess.engine.server.openai import fields

DOC = Path(__file__).resolve().parents[2] / "docs" / "openai.md"
REQUEST_TYPES = {
    fields.COMPLETIONS: completion_create_params.CompletionCreateParamsStreaming,
    fields.CHAT: chat_create_params.CompletionCreateParamsStreaming,
}


def openai_fields(kind: str) -> list[str]:
    """The request's fields as the installed openai package declares them (inherited ones too)."""
    return sorted(REQUEST_TYPES[kind].__annotations__)


@pytest.mark.parametrize("kind", [fields.COMPLETIONS, fields.CHAT])
def test_every_field_of_the_openai_request_is_honoured_or_refused(kind):
    names = openai_fields(kind)
    assert {"model", "stream", "temperature", "logprobs"} <= set(names)
    assert fields.uncovered(kind, names) == []


@pytest.mark.parametrize("kind", [fields.COMPLETIONS, fields.CHAT])
def test_the_walk_fails_on_a_field_removed_from_both_tables(kind, monkeypatch):
    """The probe: a field in neither table (as a newer openai package would add) is caught."""
    for name in ("presence_penalty", "temperature"):
        monkeypatch.setitem(
            fields.HONOURED, kind, {k: v for k, v in fields.HONOURED[kind].items() if k != name}
        )
        monkeypatch.setitem(
            fields.REFUSED, kind, {k: v for k, v in fields.REFUSED[kind].items() if k != name}
        )
        assert fields.uncovered(kind, openai_fields(kind)) == [name]
        monkeypatch.undo()


def test_a_field_is_in_one_table_and_every_refusal_has_a_reason():
    for kind in (fields.COMPLETIONS, fields.CHAT):
        assert set(fields.HONOURED[kind]) & set(fields.REFUSED[kind]) == set()
        assert all(reason.strip() for reason in fields.REFUSED[kind].values())
        assert all(note.strip() for note in fields.HONOURED[kind].values())


def test_refused_and_unknown_fields_are_400s_naming_them():
    fields.check_fields(
        fields.COMPLETIONS, {"model": "m", "prompt": "x", "presence_penalty": 0, "best_of": 1}
    )
    fields.check_fields(fields.CHAT, {"tools": [], "response_format": {"type": "text"}, "store": False})
    with pytest.raises(InvalidRequest, match="presence_penalty: not supported .*no penalties"):
        fields.check_fields(fields.COMPLETIONS, {"presence_penalty": 0.5})
    with pytest.raises(InvalidRequest, match="store: not supported"):
        fields.check_fields(fields.CHAT, {"store": True})
    with pytest.raises(InvalidRequest, match="new_option: not a field"):
        fields.check_fields(fields.CHAT, {"new_option": 1})
    with pytest.raises(InvalidRequest, match="echo: not a field"):  # a completions field sent to chat
        fields.check_fields(fields.CHAT, {"echo": True})


@pytest.mark.parametrize("kind", [fields.COMPLETIONS, fields.CHAT])
def test_docs_tables_are_the_modules(kind):
    text = DOC.read_text()
    start = text.index("\n", text.index(f"<!-- {kind} fields table:")) + 1
    end = text.index(f"<!-- end of {kind} fields table -->")
    assert text[start:end].strip() == fields.markdown_table(kind)
