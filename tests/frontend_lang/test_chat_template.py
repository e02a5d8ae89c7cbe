"""Role markup derived from a model's own chat template must reproduce that template."""

from __future__ import annotations

import jinja2.sandbox
import pytest
import transformers

from radixlm.frontend_lang.chat_template import (
    BUILTIN_TEMPLATES,
    from_renderer,
    template_for_model_name,
)
from radixlm.models.default_model import default_model_path

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi!"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]

LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
    "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
)
DEFAULT_SYSTEM = (
    "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are helpful.<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}"
)
NO_SYSTEM = (
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}"
    "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
)


def jinja_renderer(source: str, bos: str = "<s>"):
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    environment.globals["raise_exception"] = raise_exception
    template = environment.from_string(source)
    return lambda messages: template.render(messages=messages, bos_token=bos)


@pytest.mark.parametrize("source", [LLAMA3_LIKE, DEFAULT_SYSTEM])
@pytest.mark.parametrize("start", [0, 1], ids=["system-first", "user-first"])
def test_derived_template_renders_like_the_jinja_template(source, start):
    render = jinja_renderer(source)
    template = from_renderer(render, "some-model")
    assert template.name.endswith("(own template)")
    assert template.render(CONVERSATION[start:]) == render(CONVERSATION[start:])


def test_a_default_system_prompt_opens_a_conversation_without_one():
    template = from_renderer(jinja_renderer(DEFAULT_SYSTEM), "m")
    assert template.begin("user", first=True) == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n")
    assert template.begin("user", first=False) == "<|im_start|>user\n"
    assert template.begin("system", first=True) == "<|im_start|>system\n"


def test_a_template_that_rejects_system_turns_falls_back_to_a_builtin():
    assert from_renderer(jinja_renderer(NO_SYSTEM), "llama-3-8b") is BUILTIN_TEMPLATES["llama-3"]


def test_builtins_are_chosen_by_model_name():
    assert template_for_model_name("meta-llama/Meta-Llama-3-8B-Instruct").name == "llama-3"
    assert template_for_model_name("/models/Mixtral-8x7B").name == "mistral"
    assert template_for_model_name("Qwen/Qwen2-7B").name == "chatml"


def test_unknown_roles_are_refused():
    with pytest.raises(ValueError, match="role must be one of"):
        BUILTIN_TEMPLATES["chatml"].begin("tool", first=False)


@pytest.mark.default_model
@pytest.mark.parametrize("start", [0, 1], ids=["system-first", "user-first"])
def test_default_model_template_matches_apply_chat_template(start):
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_path())
    render = lambda m: tokenizer.apply_chat_template(m, tokenize=False)  # noqa: E731
    template = from_renderer(render, "SmolLM2")
    assert template.render(CONVERSATION[start:]) == render(CONVERSATION[start:])
