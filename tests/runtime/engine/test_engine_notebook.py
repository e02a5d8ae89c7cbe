"""The quickstart notebook, executed in a real Jupyter kernel, so it stays true."""

from __future__ import annotations

from pathlib import Path

import nbclient
import nbformat
import pytest

pytestmark = pytest.mark.slow  # a whole notebook in a kernel: CI's last stage

NOTEBOOK = Path(__file__).parents[3] / "docs" / "engine_quickstart.ipynb"


@pytest.mark.default_model
def test_quickstart_notebook_runs_in_a_jupyter_kernel():
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3")
    client.execute()  # raises CellExecutionError, with the cell's traceback, on any failure
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    printed = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "Tokyo" in printed
    assert "prompt tokens were cached" in printed
