"""Where the API key comes from: a flag shows in ``ps``, so a file or the environment may
hold it instead; every way of giving it is checked where the server starts."""

from __future__ import annotations

import pytest

from radixlm.runtime.server.api_key import API_KEY_ENV, resolve_api_key


def test_the_key_comes_from_the_flag_the_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None, None) is None
    assert resolve_api_key("flag-key", None) == "flag-key"
    key_file = tmp_path / "key"
    key_file.write_text("file-key \nsecond line ignored\n")
    assert resolve_api_key(None, str(key_file)) == "file-key"
    monkeypatch.setenv(API_KEY_ENV, "env-key")
    assert resolve_api_key(None, None) == "env-key"
    assert resolve_api_key("flag-key", None) == "flag-key"  # a flag wins over the environment
    assert resolve_api_key(None, str(key_file)) == "file-key"


@pytest.mark.parametrize(("given", "message"), [
    (("a", "FILE"), "not both"),
    ((None, "MISSING"), "cannot be read"),
    ((None, "EMPTY"), "no key"),
    (("  ", None), "empty"),
])
def test_a_bad_key_source_is_refused_by_name(tmp_path, given, message):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    paths = {"FILE": str(empty), "MISSING": str(tmp_path / "missing"), "EMPTY": str(empty)}
    api_key, key_file = given
    with pytest.raises(ValueError, match=message):
        resolve_api_key(api_key, paths.get(key_file, key_file))
