"""``ServiceClient.get_tokenizer`` builds a model's tokenizer from the engine's files, once per
client, and leaves nothing behind on disk: a long-running client that loads tokenizers in many
processes must not fill the temporary directory."""

from __future__ import annotations

import tempfile

from sess.engine import ServiceClient


def test_get_tokenizer_caches_and_leaves_no_files(sess_home, http_engine, tmp_path, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    with ServiceClient(http_engine["url"], home=sess_home) as svc:
        tok = svc.get_tokenizer("tiny-llama")
        assert svc.get_tokenizer("tiny-llama") is tok
        ids = tok.encode("hello there")
        assert ids and tok.decode(ids, skip_special_tokens=True).strip() == "hello there"
    assert list(scratch.iterdir()) == []
