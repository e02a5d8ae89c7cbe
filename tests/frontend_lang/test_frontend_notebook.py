"""The frontend quickstart notebook, executed in a real Jupyter kernel, so it stays true."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nbclient
import nbformat
import pytest

pytestmark = pytest.mark.slow  # a whole notebook in a kernel: CI's last stage

NOTEBOOK = Path(__file__).parents[2] / "docs" / "frontend_quickstart.ipynb"


def printed_line(printed: str, prefix: str) -> str:
    lines = [line for line in printed.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1, f"expected one line starting {prefix!r} in:\n{printed}"
    return lines[0][len(prefix):]


@pytest.mark.default_model
def test_frontend_quickstart_runs_and_shows_select_fork_streaming_and_cache_hits():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3")
    client.execute()  # raises CellExecutionError, with the cell's traceback, on any failure
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")

    # Answers whose every token leads by at least 0.9 nats in float32, so they hold in
    # bfloat16 too, whatever the CPU.
    assert "Tokyo" in printed
    label, _, labels = printed_line(printed, "label: ").partition(" of ")
    assert label in ast.literal_eval(labels)

    branches = re.findall(r"^branch (\d): cached (\d+) of (\d+) prompt tokens", printed,
                          re.MULTILINE)
    assert [int(index) for index, _, _ in branches] == [0, 1, 2]
    # The parent's text was cached before the fork; each branch computes its own label.
    assert all(0 < int(cached) < int(prompt) for _, cached, prompt in branches)

    pieces = re.search(r"^\d+ pieces: (.*)$", printed, re.MULTILINE).group(1)
    assert "Cairo" in "".join(ast.literal_eval(pieces))
    assert printed_line(printed, "the pieces make the answer: ") == "True"

    cached = ast.literal_eval(printed_line(printed, "cached tokens per item: "))
    prompt = ast.literal_eval(printed_line(printed, "prompt tokens per item: "))
    assert len(cached) == len(prompt) == 6
    assert all(0 < hit < total for hit, total in zip(cached, prompt))
    hits, total = re.search(r"^(\d+) of (\d+) prompt tokens came from the cache", printed,
                            re.MULTILINE).groups()
    assert 0 < int(hits) < int(total)
