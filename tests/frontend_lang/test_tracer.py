"""Tracing finds the text every run of a program starts with, and stops where it varies."""

from __future__ import annotations

import radixlm as sgl
from radixlm.frontend_lang.chat_template import BUILTIN_TEMPLATES
from radixlm.frontend_lang.tracer import trace_program

CHATML = BUILTIN_TEMPLATES["chatml"]


def prefix_of(program, **bound) -> str:
    return trace_program(program.func, bound, CHATML).prefix


def test_constant_text_and_roles_up_to_the_first_argument():
    @sgl.function
    def few_shot(s, question):
        s += sgl.system("Answer with one word.")
        s += sgl.user_begin() + "Q: 1+1?\nA: 2\nQ: " + question
        s += sgl.user_end() + sgl.assistant(sgl.gen("answer"))

    assert prefix_of(few_shot) == (
        "<|im_start|>system\nAnswer with one word.<|im_end|>\n<|im_start|>user\n"
        "Q: 1+1?\nA: 2\nQ: ")


def test_tracing_stops_at_gen_select_reads_and_forks():
    @sgl.function
    def at_gen(s):
        s += "Intro. " + sgl.gen("x") + " never traced"

    @sgl.function
    def at_select(s):
        s += "Pick: " + sgl.select("x", choices=["a", "b"])

    @sgl.function
    def at_read(s):
        s += "Before. "
        if s["x"]:
            s += "never traced"

    @sgl.function
    def at_fork(s):
        s += "Root. "
        s.fork(2)

    assert prefix_of(at_gen) == "Intro. "
    assert prefix_of(at_select) == "Pick: "
    assert prefix_of(at_read) == "Before. "
    assert prefix_of(at_fork) == "Root. "


def test_arguments_used_as_python_values_stop_tracing():
    @sgl.function
    def formatted(s, topic):
        s += "Topic list:\n"
        s += f"- {topic}\n"

    @sgl.function
    def looped(s, items):
        s += "Items:"
        for item in items:
            s += item

    trace = trace_program(formatted.func, {}, CHATML)
    assert trace.prefix == "Topic list:\n"
    assert "topic" in trace.stopped_at
    assert prefix_of(looped) == "Items:"


def test_bound_arguments_are_part_of_the_prefix():
    @sgl.function
    def greet(s, name, question):
        s += "Hello " + name + ". " + question

    assert prefix_of(greet, name="Ada") == "Hello Ada. "
    assert greet.bind(name="Ada").trace().prefix == "Hello Ada. "


def test_a_program_that_raises_while_tracing_keeps_what_it_traced():
    @sgl.function
    def broken(s):
        s += "Start. "
        raise RuntimeError("boom")

    trace = trace_program(broken.func, {}, CHATML)
    assert trace.prefix == "Start. "
    assert "boom" in trace.stopped_at
