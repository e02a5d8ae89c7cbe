"""One chat turn as every chat API serves it (``/v1/chat/completions``, ``/v1/messages``,
``/v1/responses``): the prompt, the constraints the request's tools and reasoning add to
sampling, and how the output is read back into reasoning, content and tool calls.

Each API turns its own body into OpenAI-style chat messages (``role``, ``content`` text,
an assistant's ``tool_calls`` with ``arguments`` as a dict, a ``tool`` message's
``tool_call_id``) and ``FunctionTool``s, and maps the ``TurnEvent``s back to its own shapes.

- **Tools.** The functions go to the chat template as ``tools`` (transformers'
  ``apply_chat_template(tools=...)`` form). The server's ``--tool-call-parser``, or the one
  detected from the template, reads the calls. ``tool_choice`` ``required`` or a named
  function, and any ``strict`` function, add a grammar (an xgrammar structural tag built
  from the functions' schemas) so the calls the parser reads always parse and validate;
  ``none`` leaves the tools out of the prompt and reads no calls.
- **Reasoning.** With ``--reasoning-parser``, ``<think>...</think>`` (or the family's tags)
  becomes reasoning, unless the request turns ``separate_reasoning`` off. A tool grammar then
  lets the thinking come first. ``max_reasoning_tokens`` forces the end-of-thinking tag once
  that many tokens were spent (``sampling/``'s thinking budget).

Reading is a stream either way: ``read`` is ``stream`` fed the whole text, so a streamed
turn and a whole one give the same reasoning, content and calls.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from radixlm.runtime.output_parsing.reasoning_parser import ReasoningParser, get_reasoning_parser
from radixlm.runtime.output_parsing.tool_call_registry import (
    detect_tool_call_parser,
    get_tool_call_parser,
)
from radixlm.runtime.output_parsing.tool_call_types import FunctionTool, ToolCall, ToolCallParser


class ChatTurnError(ValueError):
    """Bad input to a chat turn; ``param`` is the field at fault (the message names it)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolChoice:
    """``none``, ``auto``, ``required`` or ``function`` (the function ``name``)."""

    mode: Literal["none", "auto", "required", "function"] = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


TurnEvent = ReasoningDelta | ContentDelta | ToolCall


@dataclass
class TurnOutput:
    """A whole turn's output: reasoning (None where none was split off), content, calls."""

    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


class TurnStream:
    """Reads one output as it arrives: reasoning first, then content and calls. The events
    of any split of an output, joined, equal ``ChatTurn.read`` of the whole.

    - Trailing whitespace of the content is held until text follows it; an output with
      calls drops what is still held at its end (the newlines between and after calls),
      one without gives it back.
    - A call is given only if it names an offered function (others are dropped, as SGLang
      drops them: a client cannot run them), and, without ``parallel`` calls, only the
      first.
    """

    def __init__(self, tool_parser: ToolCallParser | None,
                 reasoning_parser: ReasoningParser | None, thinking: bool,
                 offered: frozenset[str] = frozenset(), parallel: bool = True):
        self._tools = tool_parser.stream() if tool_parser is not None else None
        self._reasoning = (reasoning_parser.stream(thinking)
                           if reasoning_parser is not None else None)
        self._offered, self._parallel = offered, parallel
        self._blank = ""  # whitespace-only content held back
        self._calls = 0

    def feed(self, text: str) -> list[TurnEvent]:
        if self._reasoning is None:
            return self._content(text, final=False)
        reasoning, content = self._reasoning.feed(text)
        return self._with_reasoning(reasoning, content, final=False)

    def finish(self) -> list[TurnEvent]:
        if self._reasoning is None:
            return self._content("", final=True)
        reasoning, content = self._reasoning.finish()
        return self._with_reasoning(reasoning, content, final=True)

    def _with_reasoning(self, reasoning: str, content: str, final: bool) -> list[TurnEvent]:
        events: list[TurnEvent] = [ReasoningDelta(reasoning)] if reasoning else []
        return events + self._content(content, final)

    def _content(self, text: str, final: bool) -> list[TurnEvent]:
        if self._tools is None:
            pieces: list[str | ToolCall] = [text] if text else []
        else:
            pieces = self._tools.feed(text) if text else []
            if final:
                pieces += self._tools.finish()
        events: list[TurnEvent] = []
        for piece in pieces:
            if isinstance(piece, ToolCall):
                if piece.name in self._offered and (self._parallel or not self._calls):
                    self._calls += 1
                    events.append(piece)
            else:
                # Trailing whitespace is held whatever the pieces' cut, so that any split
                # of an output gives the same events.
                kept = piece.rstrip()
                if kept:
                    events.append(ContentDelta(self._blank + kept))
                    self._blank = ""
                self._blank += piece[len(kept):]
        if final and self._blank and not self._calls:
            events.append(ContentDelta(self._blank))
        return events


@dataclass
class ChatTurn:
    """A prepared turn: generate from ``prompt_ids`` with ``sampling_params`` merged into the
    request's own, then read the output with ``read`` or ``stream``. With tools offered,
    ``sampling_params`` keeps special tokens in the text (a request may still set
    ``skip_special_tokens`` itself)."""

    prompt_ids: list[int]
    sampling_params: dict[str, Any]
    tool_parser: ToolCallParser | None
    reasoning_parser: ReasoningParser | None
    thinking: bool = True
    offered: frozenset[str] = frozenset()
    parallel_tool_calls: bool = True

    def stream(self) -> TurnStream:
        return TurnStream(self.tool_parser, self.reasoning_parser, self.thinking,
                          self.offered, self.parallel_tool_calls)

    def read(self, text: str) -> TurnOutput:
        stream = self.stream()
        events = stream.feed(text) + stream.finish()
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        return TurnOutput(
            reasoning=reasoning if self.reasoning_parser is not None and reasoning else None,
            content="".join(e.text for e in events if isinstance(e, ContentDelta)),
            tool_calls=[e for e in events if isinstance(e, ToolCall)],
        )


async def prepare_chat_turn(
    engine, messages: list[dict[str, Any]], *, tools: list[FunctionTool] | tuple = (),
    tool_choice: ToolChoice = ToolChoice(), parallel_tool_calls: bool = True,
    template_kwargs: dict[str, Any] | None = None, separate_reasoning: bool = True,
    max_reasoning_tokens: int | None = None, response_schema: dict[str, Any] | None = None,
) -> ChatTurn:
    """Checks the turn, renders and tokenizes its prompt and builds its constraints. Raises
    ``ChatTurnError`` for bad input, ``ValueError`` where the template refuses it.

    ``response_schema`` (a JSON schema: OpenAI's ``response_format``, the Responses API's
    ``text.format``) constrains the text; with tools offered under ``auto`` the output is
    then either calls or one JSON value of the schema, and under ``required`` or a named
    function calls only. ``max_reasoning_tokens`` applies where the turn thinks (a server
    reasoning parser, and the template's thinking switch on): a turn that does not think
    has no thinking to end."""
    if not getattr(engine.tokenizer, "chat_template", None):
        raise ChatTurnError("this model's tokenizer has no chat template; start the server "
                            "with --chat-template (or use the completions API)",
                            param="messages")
    tools = list(tools)
    check_tools(tools, tool_choice)
    template_kwargs = dict(template_kwargs or {})
    offered = tools if tool_choice.mode != "none" else []
    if offered:
        template_kwargs["tools"] = [tool.openai_tool() for tool in offered]
    ids = await engine.async_chat_prompt_ids(messages, template_kwargs)
    args = engine.server_args
    family = get_reasoning_parser(args.reasoning_parser) if args.reasoning_parser else None
    thinking = family is not None and family.thinking_enabled(template_kwargs)
    sampling: dict[str, Any] = {}
    tool_parser = None
    tag = None
    if offered:
        tool_parser = server_tool_parser(engine)
        # Some families' call markers are special tokens ([TOOL_CALLS], <|python_tag|>):
        # the reader must see them.
        sampling["skip_special_tokens"] = False
        tag = tool_grammar(tool_parser, offered, tool_choice, parallel_tool_calls,
                           response_schema)
    elif response_schema is not None and thinking:
        tag = {"type": "structural_tag",
               "format": {"type": "json_schema", "json_schema": response_schema}}
    elif response_schema is not None:
        sampling["json_schema"] = json.dumps(response_schema)
    if tag is not None:
        if thinking:
            tag = allowing_reasoning_first(tag, family)
        sampling["structural_tag"] = json.dumps(tag)
    if max_reasoning_tokens is not None:
        if family is None:
            raise ChatTurnError("max_reasoning_tokens needs a server started with "
                                "--reasoning-parser", param="max_reasoning_tokens")
        if thinking:
            sampling["max_reasoning_tokens"] = max_reasoning_tokens
            sampling["reasoning_end_token_ids"] = engine.tokenizer.encode(
                family.end_tag, add_special_tokens=False)
    return ChatTurn(ids, sampling, tool_parser, family if separate_reasoning else None,
                    thinking, frozenset(tool.name for tool in offered), parallel_tool_calls)


def server_tool_parser(engine) -> ToolCallParser:
    """The server's ``--tool-call-parser``, or the one its chat template shows."""
    name = engine.server_args.tool_call_parser or detect_tool_call_parser(
        getattr(engine.tokenizer, "chat_template", None))
    if name is None:
        raise ChatTurnError("tools: this model's chat template shows no tool-call format the "
                            "server knows; start it with --tool-call-parser (and a template "
                            "with tools, --chat-template)", param="tools")
    return get_tool_call_parser(name)


def tool_grammar(parser: ToolCallParser, tools: list[FunctionTool], choice: ToolChoice,
                 parallel: bool, response_schema: dict[str, Any] | None = None,
                 ) -> dict[str, Any] | None:
    """The structural tag a choice needs: calls only (``required``, a named function);
    under ``auto``, calls or a JSON value of ``response_schema`` where one is given, text
    with calls whose arguments keep their schemas where a function is ``strict``; None
    where the model is free."""
    if choice.mode == "function":
        named = [tool for tool in tools if tool.name == choice.name]
        return _structural_tag(parser, named, True, parallel, "tool_choice")
    if choice.mode == "required":
        return _structural_tag(parser, tools, True, parallel, "tool_choice")
    if response_schema is not None:
        calls = _structural_tag(parser, tools, True, parallel, "tools")
        answer = {"type": "json_schema", "json_schema": response_schema}
        return {"type": "structural_tag",
                "format": {"type": "or", "elements": [calls["format"], answer]}}
    if any(tool.strict for tool in tools):
        return _structural_tag(parser, tools, False, parallel, "tools")
    return None


def _structural_tag(parser: ToolCallParser, tools: list[FunctionTool], at_least_one: bool,
                    parallel: bool, param: str) -> dict[str, Any]:
    try:
        return parser.structural_tag(tools, at_least_one, parallel)
    except ValueError as err:
        raise ChatTurnError(f"{param}: {err}", param=param) from None


def allowing_reasoning_first(tag: dict[str, Any], parser: ReasoningParser) -> dict[str, Any]:
    """``tag`` after a free stretch of reasoning up to the end-of-thinking tag: required
    where the prompt opens the thinking, optional where the model opens it itself."""
    begin = "" if parser.starts_in_reasoning else parser.start_tag
    thinking: dict[str, Any] = {"type": "tag", "begin": begin,
                                "content": {"type": "any_text"}, "end": parser.end_tag}
    if not parser.starts_in_reasoning:
        thinking = {"type": "optional", "content": thinking}
    return {"type": "structural_tag",
            "format": {"type": "sequence", "elements": [thinking, tag["format"]]}}


def check_tools(tools: list[FunctionTool], choice: ToolChoice) -> None:
    """Unique names, object schemas, and a choice that names an offered function."""
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        if not tool.name or len(tool.name) > 128:
            raise ChatTurnError(f"tools[{index}]: a function needs a name of 1 to 128 "
                                "characters", param=f"tools[{index}].name")
        if tool.name in seen:
            raise ChatTurnError(f"tools[{index}]: the function name {tool.name!r} is given "
                                "twice", param=f"tools[{index}].name")
        seen.add(tool.name)
        schema = tool.parameters
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise ChatTurnError(f"tools[{index}] ({tool.name}): parameters must be a JSON "
                                f"schema of type object, got {json.dumps(schema)[:80]}",
                                param=f"tools[{index}].parameters")
    if choice.mode in ("required", "function") and not tools:
        raise ChatTurnError(f"tool_choice {choice.mode!r} needs tools", param="tool_choice")
    if choice.mode == "function" and choice.name not in seen:
        raise ChatTurnError(f"tool_choice names the function {choice.name!r}, which is not "
                            f"among the tools ({sorted(seen)})", param="tool_choice")


def call_arguments(text: str, param: str) -> dict[str, Any]:
    """A history call's ``arguments`` (JSON text, as the APIs send them; empty: none) as
    the dict chat templates take; ``ChatTurnError`` naming ``param`` if not an object."""
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise ChatTurnError(f"{param} must be the text of a JSON object, got {text[:80]!r}",
                            param=param)
    return value


def check_tool_messages(messages: list[dict[str, Any]]) -> None:
    """Each tool message answers a call an earlier assistant message made (OpenAI's chat
    messages; the Anthropic and Responses routes check their own blocks and items as they
    convert them, naming their fields)."""
    calls: set[str] = set()
    for index, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            calls.add(call["id"])
        if message.get("role") != "tool":
            continue
        call_id = message.get("tool_call_id")
        if call_id is None:
            raise ChatTurnError(f"messages[{index}]: a tool message needs tool_call_id",
                                param=f"messages[{index}].tool_call_id")
        if call_id not in calls:
            raise ChatTurnError(f"messages[{index}].tool_call_id {call_id!r} answers no tool "
                                "call of an earlier assistant message",
                                param=f"messages[{index}].tool_call_id")
