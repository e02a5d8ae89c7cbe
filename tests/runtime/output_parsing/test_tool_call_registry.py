"""The tool-call parser registry (``output_parsing/tool_call_registry.py``): names resolve to
parsers, unknown names are refused with the known ones, chat templates are recognised by
their families' markers; and the shipped ``chatml-tools`` template renders tools and calls
in the form the ``qwen25`` parser reads back."""

from __future__ import annotations

import json

import pytest

from radixlm.chat_templates import load_chat_template
from radixlm.runtime.output_parsing.tool_call_registry import (
    TOOL_CALL_PARSERS,
    detect_tool_call_parser,
    get_tool_call_parser,
)
from radixlm.runtime.output_parsing.tool_call_types import ToolCall, ToolCallParser

SGLANG_NAMES = {"qwen25": "qwen25", "qwen": "qwen25", "hermes": "qwen25", "llama3": "llama3",
                "mistral": "mistral", "qwen3_coder": "qwen3_coder", "deepseekv3": "deepseekv3",
                "deepseekv31": "deepseekv31", "pythonic": "pythonic"}
"""Each registered name -> the SGLang name its parser reports."""


@pytest.mark.parametrize("name", sorted(TOOL_CALL_PARSERS))
def test_every_name_gives_a_fresh_parser_of_its_family(name):
    parser = get_tool_call_parser(name)
    assert isinstance(parser, ToolCallParser)
    assert parser.name == SGLANG_NAMES[name]
    assert get_tool_call_parser(name) is not parser


def test_the_registry_holds_sglangs_names_and_vllms_hermes():
    assert set(TOOL_CALL_PARSERS) == set(SGLANG_NAMES)


def test_an_unknown_name_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match=r"--tool-call-parser 'qwen9' is unknown; known: .*"
                                         r"deepseekv3, deepseekv31, hermes, llama3, mistral"):
        get_tool_call_parser("qwen9")


# Short stand-ins for each family's template: the parts that render an assistant's calls.
HERMES_TEMPLATE = ("{%- for tool_call in message.tool_calls %}{{- '<tool_call>\\n{\"name\": \"' "
                   "}}{{- tool_call.name }}{{- '</tool_call>' }}{%- endfor %}")
QWEN3_CODER_TEMPLATE = ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
                        "{{- '<parameter=' + args_name + '>\\n' }}")
DEEPSEEK_V3_TEMPLATE = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
                        "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' }}")
DEEPSEEK_V31_TEMPLATE = ("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + "
                         "tool['function']['name'] + '<｜tool▁sep｜>' + tool['function']"
                         "['arguments'] + '<｜tool▁call▁end｜>'}}")
MISTRAL_TEMPLATE = "{{- '[TOOL_CALLS]' + tool_call.function.name + '[ARGS]' }}"
LLAMA31_TEMPLATE = ("{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
                    "{{- '<|python_tag|>' + tool_call.name + '.call(' }}")
LLAMA32_TEMPLATE = ("{%- elif message.role == \"tool\" or message.role == \"ipython\" %}"
                    "{{- \"<|start_header_id|>ipython<|end_header_id|>\\n\\n\" }}")
CHATML_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
                   "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}")


@pytest.mark.parametrize(("template", "name"), [
    (HERMES_TEMPLATE, "qwen25"),
    (QWEN3_CODER_TEMPLATE, "qwen3_coder"),
    (DEEPSEEK_V3_TEMPLATE, "deepseekv3"),
    (DEEPSEEK_V31_TEMPLATE, "deepseekv31"),
    (MISTRAL_TEMPLATE, "mistral"),
    (LLAMA31_TEMPLATE, "llama3"),
    (LLAMA32_TEMPLATE, "llama3"),
    (CHATML_TEMPLATE, None),
    ("", None),
    (None, None),
])
def test_a_template_is_recognised_by_its_familys_markers(template, name):
    assert detect_tool_call_parser(template) == name


def test_detection_finds_qwen25_in_the_shipped_chatml_tools_template():
    assert detect_tool_call_parser(load_chat_template("chatml-tools")) == "qwen25"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def render(messages: list[dict], tools: list[dict] | None = None) -> str:
    from transformers import AutoTokenizer

    from radixlm.models.default_model import default_model_path

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=True,
                                         chat_template=load_chat_template("chatml-tools"))


@pytest.mark.default_model
def test_chatml_tools_lists_the_tools_and_asks_for_hermes_calls():
    prompt = render([{"role": "user", "content": "Weather in Paris?"}], [WEATHER])
    assert prompt.startswith("<|im_start|>system\n")
    tools = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in tools.splitlines()] == [WEATHER["function"]]
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n' \
           '</tool_call>' in prompt
    assert prompt.endswith("<|im_start|>user\nWeather in Paris?<|im_end|>\n"
                           "<|im_start|>assistant\n")


@pytest.mark.default_model
def test_chatml_tools_renders_calls_the_qwen25_parser_reads_back():
    calls = [{"id": "a", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
             {"id": "b", "type": "function",
              "function": {"name": "get_weather", "arguments": {"city": "Köln"}}}]
    prompt = render([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Köln?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "a", "content": "18 C"},
        {"role": "tool", "tool_call_id": "b", "content": "12 C"},
    ], [WEATHER])
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n")
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parsed = get_tool_call_parser("qwen25").parse(turn)
    assert parsed.content == "Checking.\n\n"
    assert parsed.calls == [ToolCall("get_weather", '{"city": "Paris"}'),
                            ToolCall("get_weather", '{"city": "Köln"}')]
    assert ("<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n"
            "12 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n") in prompt


@pytest.mark.default_model
def test_chatml_tools_without_tools_is_plain_chatml():
    prompt = render([{"role": "system", "content": "Hi."},
                     {"role": "user", "content": [{"type": "text", "text": "Hello"}]}])
    assert prompt == ("<|im_start|>system\nHi.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"
                      "<|im_start|>assistant\n")


@pytest.mark.default_model
def test_chatml_tools_renders_bare_calls_and_missing_arguments_as_objects():
    prompt = render([{"role": "user", "content": "Time?"},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"name": "get_time", "arguments": None},
                         {"type": "function", "function": {"name": "get_time"}}]}])
    turn = prompt.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    assert get_tool_call_parser("qwen25").parse(turn).calls == [ToolCall("get_time", "{}")] * 2
