"""The xgrammar backend over the tiny tokenizer: compilation (cached, off the caller's
thread, errors named), masks checked against a brute-force reference over the whole
vocabulary, padding beyond the tokenizer, termination and rollback."""

from __future__ import annotations

import json
import threading

import pytest
import torch
from tiny_models import tiny_tokenizer

from radixlm.runtime.grammar.constraints import GrammarKey
from radixlm.runtime.grammar.factory import make_grammar_backend
from radixlm.runtime.grammar.xgrammar_backend import XGrammarBackend

EOS = 0
WORDS = ["cat 12", "cat 7", "catalog 3", "dog 42", "dot 0"]
FINITE_REGEX = "(cat|catalog|dog|dot) [0-9]{1,2}"
"""Its language (``WORDS`` is a sample of it) is small enough to enumerate."""


def language() -> list[bytes]:
    numbers = [str(d) for d in range(10)] + [f"{n:02d}" for n in range(100)]
    return [f"{w} {n}".encode() for w in ("cat", "catalog", "dog", "dot") for n in numbers]


@pytest.fixture(scope="module")
def backend() -> XGrammarBackend:
    tokenizer = tiny_tokenizer()
    backend = make_grammar_backend("xgrammar", tokenizer, len(tokenizer), {EOS})
    yield backend
    backend.shutdown()


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable bytes stand for themselves, the others
    for the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {byte: chr(byte) for byte in printable}
    shifted = (byte for byte in range(256) if byte not in chars)
    chars.update({byte: chr(256 + n) for n, byte in enumerate(shifted)})
    return {char: byte for byte, char in chars.items()}


def token_bytes(tokenizer) -> list[bytes]:
    """Each token's bytes, from the byte-level BPE alphabet (special tokens: b"")."""
    byte_of = byte_level_alphabet()
    special = set(tokenizer.all_special_ids)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return [b"" if i in special else bytes(byte_of[c] for c in piece)
            for i, piece in enumerate(pieces)]


def allowed(backend, matcher) -> set[int]:
    logits = torch.zeros(1, backend.vocab_size)
    backend.mask_logits(logits, [matcher])
    return set(torch.nonzero(logits[0] == 0).flatten().tolist())


def test_equal_keys_share_one_compilation_and_kinds_are_distinct(backend):
    first = backend.compile(GrammarKey("regex", "a+b"))
    assert backend.compile(GrammarKey("regex", "a+b")) is first
    assert backend.compile(GrammarKey("ebnf", 'root ::= "a"')) is not first
    assert first.result() is backend.compile(GrammarKey("regex", "a+b")).result()


def test_compilation_runs_in_the_pool_not_on_the_callers_thread():
    tokenizer = tiny_tokenizer()
    threads = []

    class Recording(XGrammarBackend):
        def _compile(self, key):
            threads.append(threading.current_thread().name)
            return super()._compile(key)

    backend = Recording(tokenizer, len(tokenizer), {EOS})
    backend.compile(GrammarKey("regex", "[0-9]+")).result(timeout=30)
    backend.shutdown()
    assert threads and threads[0].startswith("radixlm-grammar")
    assert threads[0] != threading.current_thread().name


@pytest.mark.parametrize(("kind", "text", "problem"), [
    ("regex", "foo**", "repetition"),
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("ebnf", "root ::= missing", "missing"),
])
def test_an_invalid_constraint_fails_its_future_with_a_value_error(backend, kind, text, problem):
    future = backend.compile(GrammarKey(kind, text))
    with pytest.raises(ValueError, match=problem):
        future.result(timeout=30)


def test_an_unknown_kind_or_backend_is_refused():
    with pytest.raises(ValueError, match="kind"):
        GrammarKey("glob", "*.py")
    with pytest.raises(ValueError, match="grammar_backend"):
        make_grammar_backend("outlines", tiny_tokenizer(), 384, {EOS})


def test_the_mask_allows_exactly_the_tokens_that_continue_a_word_of_the_language(backend):
    """Reference: a token is allowed iff the text so far plus its bytes is a prefix of some
    word of the (enumerated) language, or it is EOS and the text is a whole word."""
    words = language()
    tokenizer = tiny_tokenizer()
    vocab = token_bytes(tokenizer)
    compiled = backend.compile(GrammarKey("regex", FINITE_REGEX)).result()
    for word in WORDS:
        ids = tokenizer.encode(word)
        for cut in range(len(ids) + 1):
            matcher = backend.new_matcher(compiled)
            for token in ids[:cut]:
                assert matcher.accept_token(token)
            text = b"".join(vocab[t] for t in ids[:cut])
            expected = {t for t, piece in enumerate(vocab)
                        if piece and t != EOS and any(w.startswith(text + piece) for w in words)}
            if text in words:
                expected.add(EOS)
            got = allowed(backend, matcher)
            assert got == expected, (word, cut)


def test_ids_beyond_the_tokenizer_are_never_allowed():
    tokenizer = tiny_tokenizer()
    padded = XGrammarBackend(tokenizer, len(tokenizer) + 64, {EOS})
    compiled = padded.compile(GrammarKey("json_schema", '{"type": "object"}')).result()
    logits = torch.zeros(2, padded.vocab_size)
    padded.mask_logits(logits, [padded.new_matcher(compiled), None])
    assert torch.isinf(logits[0, len(tokenizer):]).all()
    assert not torch.isinf(logits[1]).any(), "a row without a matcher is left alone"
    assert not torch.isinf(logits[0]).all()
    padded.shutdown()


def test_a_matcher_terminates_only_on_eos_after_a_complete_match(backend):
    tokenizer = tiny_tokenizer()
    matcher = backend.new_matcher(backend.compile(GrammarKey("regex", "[0-9]+")).result())
    assert not matcher.accept_token(EOS), "nothing matched yet"
    assert matcher.accept_token(tokenizer.encode("7")[0])
    assert matcher.is_completed() and not matcher.is_terminated()
    assert matcher.accept_token(EOS)
    assert matcher.is_terminated()


def test_rollback_restores_the_mask_and_the_forced_text(backend):
    tokenizer = tiny_tokenizer()
    schema = json.dumps({"type": "object", "properties": {"n": {"type": "integer"}},
                         "required": ["n"]})
    matcher = backend.new_matcher(backend.compile(GrammarKey("json_schema", schema)).result())
    before_mask, before_forced = allowed(backend, matcher), matcher.jump_forward_string()
    ids = tokenizer.encode('{"n": 4')
    for token in ids:
        assert matcher.accept_token(token)
    assert allowed(backend, matcher) != before_mask
    matcher.rollback(len(ids))
    assert allowed(backend, matcher) == before_mask
    assert matcher.jump_forward_string() == before_forced == '{"n": '


def test_the_bitmask_buffer_is_reused_across_steps(backend):
    first = backend.bitmask(3)
    again = backend.bitmask(2)
    assert again.data_ptr() == first.data_ptr()


@pytest.mark.parametrize("schema", [
    {"type": "string", "maxLength": 4},
    {"type": "object", "properties": {"s": {"type": "string", "minLength": 1, "maxLength": 4}}},
])
def test_length_bounded_strings_refuse_raw_control_characters_and_keep_their_bounds(
    backend, schema
):
    """xgrammar alone lets raw control characters (invalid JSON) and invalid UTF-8 (several
    U+FFFD once decoded, beyond maxLength) into such strings; they are printable ASCII."""
    opening = '"' if schema["type"] == "string" else '{"s": "'
    closing = '"' if schema["type"] == "string" else '"}'
    compiled = backend.compile(GrammarKey("json_schema", json.dumps(schema))).result()

    tokenizer = tiny_tokenizer()
    char_of = {byte: char for char, byte in byte_level_alphabet().items()}

    def accepts(data: bytes) -> bool:
        """Whether the grammar takes ``data`` fed one byte token at a time."""
        matcher = backend.new_matcher(compiled)
        ids = tokenizer.convert_tokens_to_ids([char_of[b] for b in data])
        return all(matcher.accept_token(t) for t in ids) and matcher.is_completed()

    def string(content: bytes) -> bytes:
        return opening.encode() + content + closing.encode()

    assert accepts(string(b"abcd")) and accepts(string(b"a b~"))
    assert not accepts(string("ü".encode())), "bounded strings are printable ASCII"
    assert not accepts(string(b"abcde"))
    assert not accepts(string(b"a\x1eb")) and not accepts(string(b"a\tb"))
    assert not accepts(string(b"a\xed\xa1\x9f")), "an encoded surrogate"
    assert not accepts(string(b"a\xe0\x97\xb2")), "an overlong form"


def test_the_cpu_mask_equals_xgrammars_own_kernel_on_any_rows(backend):
    import xgrammar as xgr

    tokenizer = tiny_tokenizer()
    compiled = [backend.compile(GrammarKey("regex", r)).result()
                for r in (FINITE_REGEX, "[a-z ]+", "[0-9]{2}")]
    matchers = [backend.new_matcher(c) for c in compiled]
    assert matchers[1].accept_token(tokenizer.encode("a")[0])
    for rows in ([0, 1, 2], [0, 2], [1]):
        picked = [m if i in rows else None for i, m in enumerate(matchers)]
        logits = torch.randn(3, backend.vocab_size)
        expected = logits.clone()
        backend.mask_logits(logits, picked)
        bitmask = backend.bitmask(3).clone()
        xgr.apply_token_bitmask_inplace(expected, bitmask, indices=rows)
        assert torch.equal(logits, expected), rows
