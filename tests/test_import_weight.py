"""What importing radixlm loads: a script talking to a server, and the Detokenizer's process,
never load torch or transformers (seconds of start-up, hundreds of MiB), and the names that
do load them (``radixlm.Engine``) still import as before.

Each import runs in a fresh interpreter: this test process has torch loaded already.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import radixlm

HEAVY_MODULES = ("torch", "transformers")
DETOKENIZER_DIR = Path(radixlm.__file__).parent / "runtime" / "detokenizer"
LIGHT_MODULES = [
    "radixlm",
    "radixlm.frontend_lang",
    "radixlm.runtime.messages",
    "radixlm.runtime.server_args",
    "radixlm.runtime.engine.runtime_processes",  # every child process's entry
    *sorted(f"radixlm.runtime.detokenizer.{path.stem}".removesuffix(".__init__")
            for path in DETOKENIZER_DIR.glob("*.py")),
]


def loaded_after(code: str) -> dict[str, bool]:
    """Which of HEAVY_MODULES a fresh interpreter has loaded after running ``code``."""
    probe = (f"{code}\nimport json, sys\n"
             f"print(json.dumps({{m: m in sys.modules for m in {HEAVY_MODULES!r}}}))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=120, check=True)
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", LIGHT_MODULES)
def test_module_imports_without_torch_or_transformers(module):
    assert loaded_after(f"import {module}") == dict.fromkeys(HEAVY_MODULES, False)


def test_frontend_script_runs_without_torch():
    script = """
import radixlm
from radixlm import RuntimeEndpoint, function, gen, select

@function
def answer(s, question):
    s += question + gen("answer", max_tokens=8) + select("ok", ["yes", "no"])

try:
    RuntimeEndpoint("http://127.0.0.1:1")  # no server there: the request path still loads
except radixlm.BackendError:
    pass
"""
    assert loaded_after(script)["torch"] is False


def test_every_public_name_imports_and_is_listed():
    names = sorted(radixlm.__all__)
    code = (f"import radixlm\nfrom radixlm import {', '.join(names)}\n"
            "assert set(radixlm.__all__) <= set(dir(radixlm))")
    assert loaded_after(code)["torch"] is True  # Engine brings torch with it


def test_engine_is_the_runtime_class():
    from radixlm.runtime.engine.engine import Engine
    from radixlm.runtime.server_args import ServerArgs

    assert radixlm.Engine is Engine and radixlm.ServerArgs is ServerArgs
    with pytest.raises(AttributeError, match="no_such_name"):
        radixlm.no_such_name  # noqa: B018
