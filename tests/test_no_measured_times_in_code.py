"""No measured times in radixlm's docstrings and comments: they belong in benchmarks/RESULTS.md.

A comment keeps its reason ("the padded call costs more than the pairs it saves"); the figure
behind it ("12.5 ms against 15.3") goes stale with every machine, so it lives in
``benchmarks/RESULTS.md`` with the machine, flags and date, where a benchmark can regenerate it.

The scan reads every comment and string token of ``radixlm/**/*.py`` (with ``tokenize``, so
a ``#`` inside a string is no comment) and every ``//`` and ``/* */`` comment of
``radixlm/**/*.cpp`` and ``*.h``, and flags a number followed by a time unit. A setting is no
measurement (a timeout, a poll interval, the unit of a parameter): those few are listed in
``ALLOWLIST`` with the exact phrase and why it stays. The scanner is checked on sample text,
so that the test can fail.
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import radixlm

PACKAGE_DIR = Path(radixlm.__file__).parent

TIME_FIGURE = re.compile(
    r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?(?:[-–]\d+(?:\.\d+)?)?"
    r"\s?(?:ms|µs|us|ns|s|secs?|(?:milli|micro|nano)?seconds?|minutes?|mins?|hours?)(?![\w])"
)
"""A number (``37``, ``1.7``, ``~25``, ``1,200``, a range ``2-3``) and a time unit right after
it. Not ``s`` after a letter-led word (``fp8s``), nor ``'s``; ``1.7x`` is no time."""

ALLOWLIST: dict[tuple[str, str], str] = {
    # (path under radixlm/, exact phrase on the line): why it is not a measurement
    ("runtime/scale_out_options.py", "dist_timeout must be > 0 seconds"):
        "the allowed range of a configured timeout, in an error message",
}


# ---- the scanner ------------------------------------------------------------------------------


def python_text_pieces(source: str) -> list[tuple[int, str]]:
    """(line, text) for every comment and string token, a multi-line string split per line."""
    pieces = []
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    for token in tokens:
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            first_line = token.start[0]
            for offset, line in enumerate(token.string.splitlines()):
                pieces.append((first_line + offset, line))
    return pieces


_CPP_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_CPP_STRING = re.compile(r'"(?:\\.|[^"\\\n])*"')


def cpp_comment_pieces(source: str) -> list[tuple[int, str]]:
    """(line, text) for every ``//`` and ``/* */`` comment; string literals are skipped first
    so that ``"http://"`` opens no comment."""
    pieces = []
    blanked = _CPP_STRING.sub(lambda m: '"' + " " * (len(m.group()) - 2) + '"', source)
    for match in _CPP_COMMENT.finditer(blanked):
        first_line = source.count("\n", 0, match.start()) + 1
        for offset, line in enumerate(match.group().splitlines()):
            pieces.append((first_line + offset, line))
    return pieces


def time_figures(pieces: list[tuple[int, str]]) -> list[tuple[int, str, str]]:
    """(line, figure, text) for each measured-time figure in the pieces."""
    return [
        (line, match.group(), text)
        for line, text in pieces
        for match in TIME_FIGURE.finditer(text)
    ]


def scan_package(package_dir: Path) -> list[tuple[str, int, str, str]]:
    """(relative path, line, figure, text) for each figure in the package's comments."""
    hits = []
    for path in sorted(package_dir.rglob("*")):
        if path.suffix == ".py":
            pieces = python_text_pieces(path.read_text())
        elif path.suffix in (".cpp", ".h"):
            pieces = cpp_comment_pieces(path.read_text())
        else:
            continue
        relative = path.relative_to(package_dir).as_posix()
        hits.extend((relative, line, fig, text) for line, fig, text in time_figures(pieces))
    return hits


def unlisted(hits: list[tuple[str, int, str, str]]) -> list[tuple[str, int, str, str]]:
    return [
        hit
        for hit in hits
        if not any(path == hit[0] and phrase in hit[3] for path, phrase in ALLOWLIST)
    ]


# ---- the scanner on sample text ---------------------------------------------------------------


def test_a_measured_time_in_a_comment_is_found():
    source = 'x = 1  # the padded call: 12.5 ms against 15.3\n'
    assert [fig for _, fig, _ in time_figures(python_text_pieces(source))] == ["12.5 ms"]


def test_figures_in_docstrings_in_every_form_are_found():
    source = '"""Takes 37 us, ~25 ms, 1.7s, about 20 s, 1,200 ns, 2-3 minutes."""\n'
    figures = [fig for _, fig, _ in time_figures(python_text_pieces(source))]
    assert figures == ["37 us", "~25 ms", "1.7s", "20 s", "1,200 ns", "2-3 minutes"]


def test_words_and_code_that_only_look_like_times_are_not_found():
    source = (
        '"""fp8s, 2\'s complement, 1.7x faster, 4 steps, 16 sequences, layer 3 slots."""\n'
        "time_s = 1.5  # a 1.5 scale\n"
    )
    assert time_figures(python_text_pieces(source)) == []


def test_code_outside_comments_and_strings_is_not_scanned():
    assert time_figures(python_text_pieces("timeout = 30 * s\n")) == []
    assert time_figures(cpp_comment_pieces('int x = 30; auto u = "http://a 5 ms";\n')) == []


def test_cpp_comments_of_both_kinds_are_scanned_with_their_lines():
    source = "int a;\n// 37 us per call\n/* one\n   two: 5 ms */\nint b;  // 1 ns\n"
    assert [(line, fig) for line, fig, _ in time_figures(cpp_comment_pieces(source))] == [
        (2, "37 us"),
        (4, "5 ms"),
        (5, "1 ns"),
    ]


def test_an_allowlisted_phrase_covers_only_its_own_file():
    hits = [("runtime/a.py", 3, "2 s", "waits 2 s"), ("runtime/b.py", 4, "2 s", "waits 2 s")]
    ALLOWLIST[("runtime/a.py", "waits 2 s")] = "sample"
    try:
        assert unlisted(hits) == hits[1:]
    finally:
        del ALLOWLIST[("runtime/a.py", "waits 2 s")]


def test_a_package_with_a_figure_fails_naming_file_and_line(tmp_path):
    (tmp_path / "layer.py").write_text('"""Fast."""\n\nX = 1  # 12.5 ms against 15.3\n')
    (tmp_path / "kernel.cpp").write_text("int x;\n/* 37 us a call */\n")
    hits = unlisted(scan_package(tmp_path))
    assert [(path, line, fig) for path, line, fig, _ in hits] == [
        ("kernel.cpp", 2, "37 us"),
        ("layer.py", 3, "12.5 ms"),
    ]


# ---- the package ------------------------------------------------------------------------------


def test_no_measured_times_in_radixlm_comments_or_docstrings():
    hits = unlisted(scan_package(PACKAGE_DIR))
    report = "\n".join(f"radixlm/{path}:{line}: {fig!r} in {text.strip()!r}"
                       for path, line, fig, text in hits)
    assert not hits, (
        "measured times in comments or docstrings; keep the reason, move the figure with its "
        "machine and date to benchmarks/RESULTS.md (or, for a setting, add it to ALLOWLIST "
        f"with why):\n{report}"
    )


def test_every_allowlist_entry_still_matches_a_figure():
    hits = scan_package(PACKAGE_DIR)
    stale = [key for key in ALLOWLIST
             if not any(path == key[0] and key[1] in text for path, _, _, text in hits)]
    assert not stale, f"ALLOWLIST entries that match no figure any more: {stale}"
