"""What a constraint on a request's output is: its kinds and its key.

A constraint is a regex, a JSON schema, an EBNF grammar or an xgrammar structural tag (JSON
text; SGLang's ``structural_tag``), given as text. The sampling
parameters carry one, the entry checks it (with the configured backend's parser, see
``factory.constraint_checker``), and the scheduler's grammar backend compiles it. This
module is the vocabulary all three share; it calls no backend.
"""

from __future__ import annotations

from dataclasses import dataclass

CONSTRAINT_KINDS = ("regex", "json_schema", "ebnf", "structural_tag")


@dataclass(frozen=True)
class GrammarKey:
    """One constraint: ``kind`` is one of ``CONSTRAINT_KINDS``; ``text`` its source. Equal
    keys share one compilation."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise ValueError(f"grammar kind must be one of {CONSTRAINT_KINDS}, got {self.kind!r}")
