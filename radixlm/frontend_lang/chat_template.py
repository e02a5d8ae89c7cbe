"""Role markup for ``system`` / ``user`` / ``assistant`` blocks.

A program writes roles one piece at a time (``s += user_begin(); ...; s += user_end()``), so
a template here is a prefix and a suffix per role, plus the head of a conversation that does
not start with a system turn (a template may insert its own default system prompt there).

``from_renderer`` derives them from the model's own Jinja chat template by rendering
conversations with sentinel contents and cutting the text around them. It checks that each
longer conversation extends the shorter one; a template that fails the check (or raises)
falls back to a built-in template chosen by the model's name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

ROLES = ("system", "user", "assistant")

_SENTINELS = {"system": "RADIXLMSYSTEMSENTINEL", "user": "RADIXLMUSERSENTINEL",
              "assistant": "RADIXLMASSISTANTSENTINEL"}

Renderer = Callable[[list[dict[str, str]]], str]
"""Renders a list of ``{"role", "content"}`` messages to the model's prompt text."""


@dataclass(frozen=True)
class ChatTemplate:
    """Text around each role's content.

    Invariant: rendering ``messages`` with this template (``render``) gives the text the
    model's own template gives for the same conversation (for the templates it was derived
    from, on conversations that begin with a system or a user turn).
    """

    name: str
    prefixes: dict[str, str]
    suffixes: dict[str, str]
    system_head: str = ""
    """Text before a first system turn's content (a BOS, the system prefix)."""
    default_head: str = ""
    """Text before a first non-system turn: the BOS and any default system turn."""

    def begin(self, role: str, first: bool) -> str:
        """The text that opens a ``role`` turn (``first``: no turn came before)."""
        _check_role(role)
        if not first:
            return self.prefixes[role]
        if role == "system":
            return self.system_head
        return self.default_head + self.prefixes[role]

    def end(self, role: str) -> str:
        _check_role(role)
        return self.suffixes[role]

    def render(self, messages: list[dict[str, str]]) -> str:
        parts = []
        for index, message in enumerate(messages):
            role = message["role"]
            parts += [self.begin(role, index == 0), message["content"], self.end(role)]
        return "".join(parts)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def _chatml(name: str) -> ChatTemplate:
    prefixes = {role: f"<|im_start|>{role}\n" for role in ROLES}
    return ChatTemplate(name, prefixes, dict.fromkeys(ROLES, "<|im_end|>\n"),
                        system_head=prefixes["system"])


def _llama3() -> ChatTemplate:
    prefixes = {role: f"<|start_header_id|>{role}<|end_header_id|>\n\n" for role in ROLES}
    return ChatTemplate("llama-3", prefixes, dict.fromkeys(ROLES, "<|eot_id|>"),
                        system_head="<|begin_of_text|>" + prefixes["system"],
                        default_head="<|begin_of_text|>")


def _mistral() -> ChatTemplate:
    prefixes = {"system": "[SYSTEM_PROMPT]", "user": "[INST]", "assistant": ""}
    suffixes = {"system": "[/SYSTEM_PROMPT]", "user": "[/INST]", "assistant": "</s>"}
    return ChatTemplate("mistral", prefixes, suffixes, system_head="<s>[SYSTEM_PROMPT]",
                        default_head="<s>")


BUILTIN_TEMPLATES: dict[str, ChatTemplate] = {
    "chatml": _chatml("chatml"), "llama-3": _llama3(), "mistral": _mistral(),
}


def template_for_model_name(model_name: str) -> ChatTemplate:
    """A built-in template guessed from a model's name or path; ChatML when unknown."""
    name = model_name.lower()
    if "llama-3" in name or "llama3" in name:
        return BUILTIN_TEMPLATES["llama-3"]
    if "mistral" in name or "mixtral" in name:
        return BUILTIN_TEMPLATES["mistral"]
    return BUILTIN_TEMPLATES["chatml"]


def from_renderer(render: Renderer, model_name: str) -> ChatTemplate:
    """The template the model's own renderer implies, or a built-in fallback."""
    try:
        return _derive(render, model_name)
    except Exception:  # noqa: BLE001 - any template failure means "use a built-in"
        return template_for_model_name(model_name)


def _derive(render: Renderer, model_name: str) -> ChatTemplate:
    conversation = [{"role": role, "content": _SENTINELS[role]} for role in ROLES]
    conversation.append({"role": "user", "content": _SENTINELS["user"]})
    texts = [render(conversation[:length]) for length in range(1, 5)]
    prefixes: dict[str, str] = {}
    suffixes: dict[str, str] = {}
    previous = ""
    for text, message in zip(texts, conversation):
        if not text.startswith(previous):
            raise ValueError("the template does not render conversations incrementally")
        block = text[len(previous):]
        prefix, sentinel, suffix = block.partition(message["content"])
        if not sentinel or message["content"] in suffix:
            raise ValueError("the template does not keep message contents verbatim")
        if message["role"] in prefixes and (prefixes[message["role"]], suffixes[
                message["role"]]) != (prefix, suffix):
            raise ValueError("a role renders differently in a later turn")
        prefixes[message["role"]], suffixes[message["role"]] = prefix, suffix
        previous = text
    system_head = prefixes["system"]
    user_only = render([{"role": "user", "content": _SENTINELS["user"]}])
    user_block = prefixes["user"] + _SENTINELS["user"] + suffixes["user"]
    if not user_only.endswith(user_block):
        raise ValueError("a lone user turn renders differently")
    default_head = user_only[: len(user_only) - len(user_block)]
    later_system = system_head
    if default_head and system_head.startswith(default_head):
        later_system = system_head[len(default_head):]  # without the BOS
    prefixes["system"] = later_system
    return ChatTemplate(f"{model_name} (own template)", prefixes, suffixes,
                        system_head=system_head, default_head=default_head)
