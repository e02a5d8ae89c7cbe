"""Constraints whose jump-forward could run without end (issue 54, item 1) are 400s over
HTTP, answered at once; the server then serves a constrained request and ``/health`` is 200.

Before anything is sent, each constraint is checked in this process to be refused: were the
check to regress, this test fails there, and never hands such a grammar to a scheduler (where
``root ::= "a" root`` grew the process ~400 MB/s until the kernel killed it)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from radixlm.runtime.grammar.xgrammar_backend import check_constraint

SELF_REQUIRED = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
DOUBLING = "root ::= a1 a1\n" + "".join(f"a{i} ::= a{i + 1} a{i + 1}\n" for i in range(1, 40))
ABUSIVE = [
    ("ebnf", 'root ::= "a" root'),
    ("ebnf", 'root ::= "b" | "a" x\nx ::= "a" x'),
    ("ebnf", 'root ::= a\na ::= "x" b\nb ::= "y" a'),
    ("json_schema", json.dumps(SELF_REQUIRED)),
    ("ebnf", DOUBLING + 'a40 ::= "x"\n'),
    ("ebnf", 'root ::= "a"{1000000000}'),
    ("regex", "(a{1000}){1000}"),
    ("json_schema", '{"items":' * 1000 + "{}" + "}" * 1000),
]
ANSWER_S = 5.0
"""Each refusal takes milliseconds; this leaves room for a loaded machine."""


def generate(url: str, kind: str, text: str) -> httpx.Response:
    body = {"text": "Say something.", "sampling_params": {"max_new_tokens": 8, kind: text}}
    return httpx.post(f"{url}/generate", json=body, timeout=60)


@pytest.mark.parametrize(("kind", "text"), ABUSIVE)
def test_the_constraint_is_refused_where_it_enters(kind, text):
    with pytest.raises(ValueError, match=f"^{kind}"):
        check_constraint(kind, text)


def test_unbounded_grammars_are_400s_and_the_server_keeps_serving(live):
    for kind, text in ABUSIVE:  # never sent unless refused here
        with pytest.raises(ValueError):
            check_constraint(kind, text)
    url = live()
    for kind, text in ABUSIVE:
        start = time.monotonic()
        response = generate(url, kind, text)
        assert time.monotonic() - start < ANSWER_S, (kind, text[:40])
        assert response.status_code == 400, (kind, text[:40], response.text)
        assert response.json()["error"]["message"].startswith(kind)
    served = generate(url, "regex", "(yes|no)")
    assert served.status_code == 200, served.text
    assert served.json()["text"] in ("yes", "no")
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
