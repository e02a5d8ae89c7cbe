"""One request's stop strings and stop regexes, matched on its output text as it grows.

Both kinds are matched by cursors that only ever read each character once
(``stop_strings``: Aho–Corasick; ``stop_regex``: a Pike VM), so the cost of a call is
linear in the text added since the previous one, whatever the number of stops, their
length, or the shape of a regex.
"""

from __future__ import annotations

from radixlm.runtime.detokenizer.stop_regex import compile_stop_regex
from radixlm.runtime.detokenizer.stop_strings import StopStringCursor, stop_string_automaton


class StopMatcher:
    """Finds the first stop string or stop regex in a growing text.

    Contract for callers: the text only grows (each call's ``text`` starts with the
    previous call's), and

    - ``search(text, new_len)`` is passed, on every call, exactly the characters appended
      since the previous ``search`` as the last ``new_len`` of ``text`` (nothing else is
      read: a character skipped is a character never searched);
    - ``held_back(text)`` is passed the whole current text; it reads what it has not read
      before.

    The two keep separate positions (the Scheduler searches, the Detokenizer holds back;
    an instance may do both). What counts as a match: a stop string occurring in the
    text, or a non-empty substring a stop regex matches in full (``stop_regex``'s
    docstring says which patterns and how). ``search`` considers the matches that end in
    the new characters and returns the one that starts first; ties go to the earliest
    end, then to stop strings before regexes, then to the regex listed first.
    """

    def __init__(self, stop: list[str], stop_regex: list[str]):
        self.stop = stop
        automaton = stop_string_automaton(tuple(stop)) if stop else None
        self._search_strings: StopStringCursor | None = automaton.cursor() if automaton else None
        self._held_strings: StopStringCursor | None = automaton.cursor() if automaton else None
        self._regexes = [compile_stop_regex(pattern).cursor() for pattern in stop_regex]

    def search(self, text: str, new_len: int) -> tuple[int, int, str] | None:
        """(start, end, matched) of the earliest match that ends in the new text, or None."""
        if new_len <= 0:
            return None
        new_text = text[len(text) - new_len:]
        best = self._search_strings.feed(new_text) if self._search_strings else None
        for regex in self._regexes:
            found = regex.feed(new_text)
            if found is not None and (best is None or found < best[:2]):
                best = (found[0], found[1], text[found[0]:found[1]])
        return best

    def held_back(self, text: str) -> int:
        """How many trailing characters could be the start of a stop string (not streamed
        yet): the longest suffix of ``text`` that is a proper prefix of a stop string."""
        cursor = self._held_strings
        if cursor is None:
            return 0
        cursor.feed(text[cursor.position:])
        return cursor.held

    @property
    def steps(self) -> int:
        """Work done so far, in automaton transitions and regex instruction visits."""
        cursors = [self._search_strings, self._held_strings, *self._regexes]
        return sum(cursor.steps for cursor in cursors if cursor is not None)
