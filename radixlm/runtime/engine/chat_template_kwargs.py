"""What a chat request may pass to the chat template (SGLang's ``chat_template_kwargs``).

The keys are template variables (``enable_thinking``, ``tools``, ``documents``...). None of
them may be an option of the rendering itself (``tokenize``, ``return_tensors``,
``tokenizer_kwargs``...: transformers' ``apply_chat_template`` takes variables and options in
one set of keyword arguments), and ``chat_template``, a template of the client's own, is code
the server would run: it is refused unless the operator allows it
(``ServerArgs.trust_request_chat_template``, vLLM's ``--trust-request-chat-template``), and
even then runs in a process of its own (``client_template_renderer``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from transformers import PreTrainedTokenizerBase

CLIENT_TEMPLATE = "chat_template"
TEMPLATE_INPUTS = frozenset({"tools", "documents"})
"""``apply_chat_template``'s parameters that are template variables a request may set."""
RENDER_OPTIONS = frozenset(
    inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters
) - TEMPLATE_INPUTS - {"self", "kwargs", CLIENT_TEMPLATE} | {"messages"}
"""The rendering's own options (and the messages), which no request sets through
``chat_template_kwargs``."""


def check_template_kwargs(kwargs: Mapping[str, Any], trust_request_template: bool) -> bool:
    """Raises ``ValueError`` naming a key a request may not set; returns whether the request
    brings its own template (only where ``trust_request_template``)."""
    options = sorted(RENDER_OPTIONS & set(kwargs))
    if options:
        raise ValueError(f"chat_template_kwargs may not set {options}: they are options of the "
                         "rendering, not template variables")
    if CLIENT_TEMPLATE not in kwargs:
        return False
    if not trust_request_template:
        raise ValueError("chat_template_kwargs.chat_template: this server does not run a "
                         "template sent with a request (its operator may allow it with "
                         "--trust-request-chat-template)")
    if not isinstance(kwargs[CLIENT_TEMPLATE], str):
        raise ValueError("chat_template_kwargs.chat_template must be a string")
    return True
