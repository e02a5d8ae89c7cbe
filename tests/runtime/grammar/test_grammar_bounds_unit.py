"""Grammar bounds (issue 54, item 1): constraints that could make jump-forward walk without
end, or further than any output budget, are refused where they enter with a ValueError
naming the constraint kind; every grammar of the corpus passes; the run-time bound on forced
text holds against xgrammar itself on random grammars; a matcher skips jump-forward past it;
and a grammar in an unverified serialization is measured as nothing (never refused, never
jumped)."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from grammar_corpus import JSON_SCHEMAS, REGEXES
from hypothesis import example, given, settings
from hypothesis import strategies as st
from tiny_models import tiny_tokenizer

from radixlm.runtime.grammar.constraints import GrammarKey
from radixlm.runtime.grammar.grammar_bounds import (
    MAX_FORCED_BYTES,
    MAX_GRAMMAR_EXPRESSIONS,
    MAX_SHORTEST_COMPLETION,
    UNMEASURED,
    measure,
)
from radixlm.runtime.grammar.grammar_graph import VERIFIED_FORMATS
from radixlm.runtime.grammar.jump_forward import JumpForward
from radixlm.runtime.grammar.xgrammar_backend import (
    MAX_SCHEMA_DEPTH,
    XGrammarMatcher,
    check_constraint,
    constraint_bounds,
    regex_grammar_json,
)

EOS = 0


def chain(defs: dict, top: str) -> str:
    return json.dumps({"$defs": defs, "$ref": f"#/$defs/{top}"})


def ref(name: str) -> dict:
    return {"$ref": f"#/$defs/{name}"}


def required(**properties) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties)}


NEVER_FINISHED = [
    ("ebnf", 'root ::= "a" root'),
    ("ebnf", 'root ::= "b" | "a" x\nx ::= "a" x'),
    ("ebnf", 'root ::= a\na ::= "x" b\nb ::= "y" a'),
    ("ebnf", 'root ::= "[" root "]"'),
    ("ebnf", 'root ::= "q" | x{1,3}\nx ::= "a" x'),
    ("ebnf", 'root ::= TagDispatch(("<tool>", call))\ncall ::= "{" call "}"'),
    ("ebnf", 'root ::= Regex("[0-9]+") tail\ntail ::= "," tail'),
    ("json_schema", json.dumps(required(a={"$ref": "#"}))),
    ("json_schema", json.dumps({"type": "array", "items": {"$ref": "#"}, "minItems": 1})),
    ("json_schema", chain({"A": required(b=ref("B")), "B": required(a=ref("A"))}, "A")),
    ("json_schema", json.dumps({"anyOf": [{"type": "null"}, required(a={"$ref": "#/anyOf/1"})]})),
]
"""Grammars with a part that can be started but never finished."""

TOO_LONG = [
    ("ebnf", "root ::= a1 a1\n" + "".join(f"a{i} ::= a{i + 1} a{i + 1}\n" for i in range(1, 40))
     + 'a40 ::= "x"\n'),
    ("ebnf", 'root ::= "a"{1000000000}'),
    ("ebnf", 'root ::= "ok" | "a" x\nx ::= "b"{200000}'),
    ("ebnf", 'root ::= Regex("a{200000}")'),
    ("regex", "(a{1000}){1000}"),
    ("regex", "x{100001}"),
    ("json_schema", json.dumps({"type": "string", "pattern": "^(a{1000}){1000}$"})),
    ("json_schema", chain({"d0": {"type": "integer"},
                           **{f"d{i}": required(x=ref(f"d{i - 1}"), y=ref(f"d{i - 1}"))
                              for i in range(1, 41)}}, "d40")),
    ("json_schema", json.dumps({"type": "array", "items": {"type": "integer"},
                                "minItems": 200_000})),
]
"""Grammars whose shortest completion is finite but over ``MAX_SHORTEST_COMPLETION``."""


@pytest.mark.parametrize(("kind", "text"), NEVER_FINISHED)
def test_a_part_that_can_never_be_finished_is_refused_naming_the_kind(kind, text):
    with pytest.raises(ValueError, match=f"^{kind}.*can never be completed") as refused:
        check_constraint(kind, text)
    assert "rule '" in str(refused.value)


@pytest.mark.parametrize(("kind", "text"), TOO_LONG)
def test_a_part_too_long_to_finish_is_refused_naming_the_kind_and_the_limit(kind, text):
    with pytest.raises(ValueError, match=f"^{kind}.*too long") as refused:
        check_constraint(kind, text)
    assert f"{MAX_SHORTEST_COMPLETION:,}" in str(refused.value)


def test_the_refusal_names_the_rule_that_cannot_finish():
    with pytest.raises(ValueError, match="rule 'x'"):
        check_constraint("ebnf", 'root ::= "b" | "a" x\nx ::= "a" x')
    with pytest.raises(ValueError, match="1,099,511,627,776 bytes"):
        check_constraint(*TOO_LONG[0])


def test_a_grammar_of_too_many_expressions_or_a_schema_nested_too_deep_is_refused():
    enum = json.dumps({"enum": [f"value {i}" for i in range(MAX_GRAMMAR_EXPRESSIONS // 2)]})
    with pytest.raises(ValueError, match="^json_schema is too large.*20,000"):
        check_constraint("json_schema", enum)
    nested = '{"items":' * MAX_SCHEMA_DEPTH + "{}" + "}" * MAX_SCHEMA_DEPTH
    with pytest.raises(ValueError, match="^json_schema is nested 65 levels"):
        check_constraint("json_schema", nested)
    check_constraint("json_schema", nested[len('{"items":'):-1])  # 64 levels pass
    deeper_than_python = '{"items":' * 100_000 + "{}" + "}" * 100_000
    with pytest.raises(ValueError, match="^json_schema is nested too deeply"):
        check_constraint("json_schema", deeper_than_python)


def test_a_part_that_cannot_even_start_is_not_refused():
    """Unreachable or unstartable non-productive rules can never be entered by the matcher."""
    check_constraint("ebnf", 'root ::= x "a" | "b"\nx ::= x')
    check_constraint("ebnf", 'root ::= "a"\nunused ::= "b" unused')


@pytest.mark.parametrize(("what", "schema"), JSON_SCHEMAS, ids=[w for w, _ in JSON_SCHEMAS])
def test_every_corpus_schema_passes_and_never_loses_jump_forward(what, schema):
    bounds = constraint_bounds("json_schema", json.dumps(schema))
    assert bounds.allows_jump_forward(1 << 20)  # a megabyte of output: still jumps


@pytest.mark.parametrize(("what", "regex"), REGEXES, ids=[w for w, _ in REGEXES])
def test_every_corpus_regex_passes(what, regex):
    assert constraint_bounds("regex", regex).allows_jump_forward(1 << 20)


def test_free_json_nests_a_few_bytes_per_byte():
    """JSON values of any shape nest: the forced closing brackets grow with the text, a few
    bytes for each byte, so jump-forward stays on for hundreds of kilobytes of output."""
    bounds = measure("json_schema", xgr.Grammar.builtin_json_grammar().serialize_json(),
                     regex_grammar_json)
    assert 0 < bounds.cyclic <= 8
    assert bounds.allows_jump_forward(100_000)


def test_a_grammar_in_an_unverified_serialization_is_unmeasured_not_refused():
    serialized = json.loads(xgr.Grammar.from_ebnf('root ::= "a" root').serialize_json())
    assert serialized["__VERSION__"] in VERIFIED_FORMATS  # else: check grammar_graph.py again
    serialized["__VERSION__"] = "v999"
    assert measure("ebnf", json.dumps(serialized), regex_grammar_json) == UNMEASURED
    serialized["__VERSION__"] = next(iter(VERIFIED_FORMATS))
    serialized["grammar_expr_indptr"].append(10**6)  # an expression out of range
    assert measure("ebnf", json.dumps(serialized), regex_grammar_json) == UNMEASURED
    assert not UNMEASURED.allows_jump_forward(0)


@pytest.mark.parametrize(("kind", "text"), [
    ("json_schema", json.dumps({"type": "string", "pattern": "(?i)^abc$"})),  # not in from_regex
    ("json_schema", json.dumps({"type": "string", "pattern": "^(?=.*[0-9]).{8,}$"})),
    ("ebnf", 'root ::= Token(5, 6) "a"'),  # bytes depend on the vocabulary
    ("ebnf", 'root ::= ExcludeToken(5) "a"'),
])
def test_a_grammar_that_cannot_be_measured_is_served_without_jump_forward(kind, text):
    assert constraint_bounds(kind, text) == UNMEASURED


def test_an_unmeasured_matcher_never_jumps_forward(backend):
    tokenizer = tiny_tokenizer()
    compiled = backend.compile(GrammarKey("ebnf", 'root ::= "{" "name" "}"')).result()
    brace = tokenizer.encode("{")[0]
    measured = backend.new_matcher(compiled)
    assert measured.accept_token(brace)
    assert measured.jump_forward_string() == 'name}'
    unmeasured = XGrammarMatcher(xgr.GrammarMatcher(compiled.grammar), UNMEASURED,
                                 [1] * backend.vocab_size)
    assert unmeasured.accept_token(brace)
    assert unmeasured.jump_forward_string() == ""


def test_jump_forward_stops_where_nesting_could_force_over_the_limit(backend):
    """Each "a" owes 90,000 bytes after the "c": forced texts of 90,000 n bytes. The matcher
    jumps while the bound allows it, stops past ``MAX_FORCED_BYTES``, and counts bytes back
    on rollback."""
    text = 'root ::= "a" root "b"{90000} | "c"'
    tokenizer = tiny_tokenizer()
    a, c = tokenizer.convert_tokens_to_ids(["a", "c"])
    bounds = constraint_bounds("ebnf", text)
    matcher = backend.new_matcher(backend.compile(GrammarKey("ebnf", text)).result())
    for n in range(1, 12):
        assert matcher.accept_token(a)
        assert matcher.accept_token(c)
        forced = matcher.jump_forward_string()
        if bounds.allows_jump_forward(n + 1):
            assert forced == "b" * 90_000 * n
        else:
            assert forced == ""
            assert n >= 8
        matcher.rollback(1)
    assert not bounds.allows_jump_forward(12)
    matcher.rollback(10)
    assert matcher.accept_token(c)
    assert matcher.jump_forward_string() == "b" * 90_000


def test_only_the_text_limit_tokens_can_cover_is_tokenized(backend):
    seen = []

    class Recording(JumpForward):
        def _encode(self, text):
            seen.append(len(text))
            return super()._encode(text)

    jump = Recording(tiny_tokenizer())
    text = 'root ::= "{" "b"{50000}'
    matcher = backend.new_matcher(backend.compile(GrammarKey("ebnf", text)).result())
    brace = tiny_tokenizer().encode("{")[0]
    assert matcher.accept_token(brace)
    tokens = jump.jump(matcher, brace, limit=4)
    assert tokens is not None and len(tokens) <= 4
    assert max(seen) <= 5 * jump.longest_token + 1
    assert set(tiny_tokenizer().decode(tokens[1:])) == {"b"}


# The run-time bound against xgrammar: on random grammars over "a" and "b", at every text a
# random walk reaches, the shortest completion (found breadth-first with the matcher) is
# within the bound, and the forced text within the shortest completion. xgrammar's forced
# walk is called only where a completion within SEARCH_DEPTH bytes was found, so it always
# ends, whatever the bound says.

SEARCH_DEPTH = 7
CHARACTERS = ["a", "b", "</s>"]


@st.composite
def grammars(draw) -> str:
    rules = draw(st.integers(1, 4))
    literal = st.text("ab", min_size=1, max_size=3).map(lambda s: f'"{s}"')
    rule = st.integers(0, rules - 1).map(lambda i: f"r{i}")
    element = st.one_of(
        rule,
        st.tuples(st.sampled_from("ab"), st.integers(0, 3)).map(lambda t: f'"{t[0]}"{{{t[1]}}}'),
        st.sampled_from(['"a"*', '"b"*']),
        literal,
    )
    nested = st.tuples(rule, literal).map(lambda t: f'"a" {t[0]} {t[1]}')  # owes its tail
    sequence = st.one_of(nested, st.lists(element, min_size=1, max_size=3).map(" ".join))
    bodies = draw(st.lists(st.lists(sequence, min_size=1, max_size=3).map(" | ".join),
                           min_size=rules, max_size=rules))
    return "root ::= r0\n" + "".join(f"r{i} ::= {body}\n" for i, body in enumerate(bodies))


@pytest.fixture(scope="module")
def character_compiler():
    info = xgr.TokenizerInfo(CHARACTERS, stop_token_ids=[2])
    return xgr.GrammarCompiler(info, max_threads=1)


def shortest_completion(matcher, depth: int) -> int | None:
    """The fewest characters that complete ``matcher``'s text, if at most ``depth``."""
    frontier = [matcher]
    for length in range(depth + 1):
        if any(m.is_completed() for m in frontier):
            return length
        following = []
        for m in frontier:
            for character in "ab":
                child = m.fork()
                if child.accept_string(character):
                    following.append(child)
        frontier = following
    return None


@settings(max_examples=300, deadline=None)
@example(text='root ::= r0\nr0 ::= "a" r0 "b" | "b"\n', walk=list("aaaaaa"))  # cyclic
@example(text='root ::= r0\nr0 ::= "a"{2} | "b"{3} r0\n', walk=[])  # acyclic, a repeat
@example(text='root ::= r0 "ab"\nr0 ::= "b" r1 "aa"\nr1 ::= "a"\n', walk=["b"])  # acyclic
@given(text=grammars(), walk=st.lists(st.sampled_from("aaab"), max_size=12))
def test_forced_text_is_within_the_bound_on_random_grammars(character_compiler, text, walk):
    grammar = xgr.Grammar.from_ebnf(text)
    try:
        bounds = measure("ebnf", grammar.serialize_json(), regex_grammar_json)
    except ValueError:
        return
    matcher = xgr.GrammarMatcher(character_compiler.compile_grammar(grammar))
    for accepted, first in enumerate([*walk, "a"]):  # one character a step, "a" mostly
        shortest = shortest_completion(matcher, SEARCH_DEPTH)
        if shortest is None:
            return
        assert shortest <= bounds.forced_bytes(accepted), (text, accepted, bounds)
        assert len(matcher.find_jump_forward_string()) <= shortest
        if not (matcher.accept_string(first) or matcher.accept_string("ab"[first == "a"])):
            return


def test_the_forced_bytes_limit_covers_the_longest_allowed_completion():
    assert MAX_SHORTEST_COMPLETION < MAX_FORCED_BYTES
