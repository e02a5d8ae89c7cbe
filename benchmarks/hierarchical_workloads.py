"""The multi-turn workloads of ``bench_hierarchical_cache.py``, built here, deterministic
(seeded), from text the standard library carries (module docstrings).

``chat`` (``conversations``): conversations over a few shared system prompts. Conversation c
uses system prompt ``c % len(SYSTEM_MODULES)`` (a reference passage of a few hundred tokens);
its user turns are questions of some tens of tokens about sentences of other modules'
docstrings.

``agent`` (``agent_sessions``): the issue's own motivating case, an agent that comes back to
the same long context every few minutes. Every session shares one system prompt; its first
user message carries the session's own document (a tool's output: ``document_tokens`` tokens
of docstring sentences in a seeded order, so two sessions share no more than the system
prompt and a few tokens of the header) and a first question; every later turn is the last
answer and a short follow-up (at most 40 tokens, some 30 on average). Each later turn thus
adds a few tens of tokens to a context of some thousand or more that only a cache which kept
it can skip; the radix cache alone keeps the shared system prompt but loses the documents
once the other sessions have pushed them out of L1.

Prompts are built as token ids, the way a chat client's history grows: turn k + 1's prompt
is turn k's prompt, the model's answer (its output ids), then the chat template's tokens
that close the answer, open a user message with the new question and open the next answer.
So each prompt extends the last one's prompt and output token for token, as a prefix cache
needs (``template_pieces`` checks the pieces against the tokenizer's own chat template).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

SYSTEM_MODULES = ("argparse", "pdb", "statistics", "unittest")
QUESTION_MODULES = ("re", "json", "csv", "socketserver", "heapq", "inspect", "timeit",
                    "hashlib", "copy", "uuid", "pydoc", "cmd", "difflib", "textwrap")
QUESTIONS = ("In one short sentence, how does the reference relate to this: {}",
             "Give a one-line answer. Which part of the reference helps with: {}",
             "Briefly, is this consistent with the reference? {}",
             "Name one option from the reference that matters for: {}")
FOLLOW_UPS = ("Look at the document again. Does it say anything about this: {}",
              "One line, from the document only: {}",
              "Has anything in the document changed this? {}",
              "Quote the document's closest line to: {}")
AGENT_SYSTEM = ("You are an agent. A tool's output is given in the user's first message; "
                "answer the user's follow-up questions from it, in one short line.")
PLACEHOLDER = "\x00ANSWER\x00"


def passage(module: str, chars: int) -> str:
    """The start of ``module``'s docstring, cut at a line end."""
    import importlib
    import inspect

    text = inspect.getdoc(importlib.import_module(module)) or ""
    return text if len(text) <= chars else text[: text.rfind("\n", 0, chars)]


def sentences() -> list[str]:
    """Sentences of the question modules' docstrings, each on one line."""
    found = []
    for module in QUESTION_MODULES:
        text = " ".join(passage(module, 4000).split())
        found += [s.strip() + "." for s in text.split(". ") if len(s.split()) >= 6]
    return found


@dataclass(frozen=True)
class TemplatePieces:
    """Token ids of the chat template around the messages."""

    first: tuple[list[int], list[int], list[int]]
    """Before the system text, between it and the first question, after the question."""
    next_turn: tuple[list[int], list[int]]
    """After an answer up to the next question, after the question."""


def template_pieces(tokenizer) -> TemplatePieces:
    """Splits the tokenizer's chat template at the messages (placeholders) and checks that
    the pieces, joined to the messages' ids, are the template's own tokens."""
    def render(messages, generation=True):
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation)

    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    sys_, q1, q2 = "\x00SYSTEM\x00", "\x00Q1\x00", "\x00Q2\x00"
    one = render([{"role": "system", "content": sys_}, {"role": "user", "content": q1}])
    two = render([{"role": "system", "content": sys_}, {"role": "user", "content": q1},
                  {"role": "assistant", "content": PLACEHOLDER},
                  {"role": "user", "content": q2}])
    head, rest = one.split(sys_)
    middle, tail = rest.split(q1)
    between, after = two.split(PLACEHOLDER)[1].split(q2)
    pieces = TemplatePieces((ids(head), ids(middle), ids(tail)), (ids(between), ids(after)))
    system, question = "You are a helpful assistant.", "What is a prefix cache?"
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": question}],
        add_generation_prompt=True)
    if not isinstance(expected, list):  # (newer transformers return an encoding)
        expected = expected["input_ids"]
    if first_prompt(pieces, ids(system), ids(question)) != list(expected):
        raise ValueError("the chat template does not split into pieces at the messages")
    return pieces


def first_prompt(pieces: TemplatePieces, system: list[int], question: list[int]) -> list[int]:
    head, middle, tail = pieces.first
    return head + system + middle + question + tail


def next_prompt(pieces: TemplatePieces, prompt: list[int], answer: list[int],
                question: list[int]) -> list[int]:
    between, after = pieces.next_turn
    return prompt + answer + between + question + after


@dataclass(frozen=True)
class Conversations:
    """The token ids of the system prompts and of every conversation's questions."""

    system: list[list[int]]
    system_of: list[int]
    """Conversation -> its system prompt's index."""
    questions: list[list[list[int]]]
    """Conversation -> its questions, one per turn (and one more: the turn after a restart)."""


def conversations(tokenizer, count: int, turns: int, system_chars: int = 1500,
                  seed: int = 0) -> Conversations:
    """``count`` conversations of ``turns`` questions (plus one), seeded."""
    rng = random.Random(seed)
    pool = sentences()
    system = [tokenizer(
        "You are a helpful assistant. Answer using the reference below.\n\nReference:\n"
        + passage(module, system_chars), add_special_tokens=False)["input_ids"]
        for module in SYSTEM_MODULES]
    questions = []
    for _ in range(count):
        asked = []
        for _ in range(turns + 1):
            quote = " ".join(rng.sample(pool, 2))
            text = rng.choice(QUESTIONS).format(quote)
            asked.append(tokenizer(text, add_special_tokens=False)["input_ids"][:80])
        questions.append(asked)
    return Conversations(system, [c % len(system) for c in range(count)], questions)


def agent_sessions(tokenizer, count: int, turns: int, document_tokens: int = 1500,
                   seed: int = 0) -> Conversations:
    """``count`` agent sessions of ``turns`` questions (plus one), seeded: one shared system
    prompt; a session's first question opens with its own document of ``document_tokens``
    tokens, its later ones are follow-ups of at most 40 tokens."""
    def ids(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    rng = random.Random(seed)
    pool = sentences()
    system = ids(AGENT_SYSTEM + "\n\nTools reference:\n" + passage(SYSTEM_MODULES[0], 1500))
    questions = []
    for session in range(count):
        text = f"Tool output (session {session}):\n"
        while len(text) < 6 * document_tokens:  # (a token is 4-5 characters of prose)
            text += "\n".join(rng.sample(pool, len(pool))) + "\n"
        document = ids(text)[:document_tokens]
        asked = [document + ids("\n\n" + rng.choice(QUESTIONS).format(rng.choice(pool)))[:80]]
        for _ in range(turns):
            asked.append(ids(rng.choice(FOLLOW_UPS).format(rng.choice(pool)))[:40])
        questions.append(asked)
    return Conversations([system], [0] * count, questions)
