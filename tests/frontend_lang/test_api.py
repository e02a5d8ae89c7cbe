"""The primitives check their arguments when the program is written, naming the bad one."""

from __future__ import annotations

import re

import pytest

import radixlm as sgl
from radixlm.frontend_lang import ir


def test_gen_options_map_to_native_sampling_params():
    expr = sgl.gen("x", max_tokens=7, stop=["\n"], temperature=0.5, top_k=3, dtype=int,
                   return_logprob=True, top_logprobs_num=2)
    params = expr.params.merged_over(ir.GenParams(max_new_tokens=128, temperature=1.0,
                                                  top_p=0.9))
    assert params.native_sampling_params() == {
        "max_new_tokens": 7, "stop": ["\n"], "temperature": 0.5, "top_p": 0.9, "top_k": 3,
        "regex": ir.DTYPE_REGEXES["int"]}
    assert params.native_logprob_options() == {"return_logprob": True, "top_logprobs_num": 2}


@pytest.mark.parametrize("dtype,good,bad", [
    ("int", ["0", "-12", "9007"], ["01", "1.5", "+3", ""]),
    ("float", ["0", "-1.25", "3.0"], ["1.", ".5", "1e3"]),
    ("bool", ["True", "False"], ["true", "1"]),
    ("str", ['"hi there"', '""'], ['"a"b"', "hi", '"line\nbreak"']),
])
def test_dtype_regexes(dtype, good, bad):
    pattern = re.compile(ir.DTYPE_REGEXES[dtype])
    assert all(pattern.fullmatch(text) for text in good)
    assert not any(pattern.fullmatch(text) for text in bad)


def test_gen_with_choices_is_a_select():
    expr = sgl.gen("x", choices=["a", "b"])
    assert isinstance(expr, ir.Select) and expr.choices == ("a", "b")
    assert expr.choices_method is sgl.token_length_normalized


def test_json_schema_dicts_become_json_text():
    expr = sgl.gen("x", json_schema={"type": "object"})
    assert expr.params.native_sampling_params()["json_schema"] == '{"type": "object"}'


@pytest.mark.parametrize("make,message", [
    (lambda: sgl.select("x", choices=[]), "needs a non-empty list of choices"),
    (lambda: sgl.select("x"), "needs a non-empty list of choices"),
    (lambda: sgl.select("x", choices=["a", ""]), "non-empty strings"),
    (lambda: sgl.gen("x", dtype=list), "dtype must be"),
    (lambda: sgl.gen("x", regex="a(b"), "not a valid regular expression"),
    (lambda: sgl.gen("x", regex="a", json_schema="{}"), "at most one of"),
    (lambda: sgl.gen(3), "variable name must be a str"),
])
def test_bad_primitives_raise_naming_the_problem(make, message):
    with pytest.raises((ValueError, TypeError), match=message):
        make()


def test_appending_something_that_is_not_text_is_refused():
    with pytest.raises(TypeError, match="cannot append a dict"):
        ir.as_expr({"a": 1})


def test_the_sglang_surface_is_exported():
    names = ["function", "gen", "gen_int", "gen_string", "select", "image", "system", "user",
             "assistant", "system_begin", "system_end", "user_begin", "user_end",
             "assistant_begin", "assistant_end", "set_default_backend", "flush_cache",
             "get_server_info", "RuntimeEndpoint", "Engine", "OpenAI",
             "token_length_normalized", "greedy_token_selection",
             "unconditional_likelihood_normalized"]
    assert [name for name in names if not hasattr(sgl, name)] == []


def test_running_without_a_backend_says_how_to_set_one():
    @sgl.function
    def program(s):
        s += "x"

    sgl.set_default_backend(None)
    with pytest.raises(ValueError, match="set_default_backend"):
        program.run()
