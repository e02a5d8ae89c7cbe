"""One OpenMP wait policy for every radixlm process (``radixlm/openmp_policy.py``): a short
spin, unless the user set ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``, which always win."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from radixlm.openmp_policy import SHORT_SPIN_COUNT, apply_openmp_policy

POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def policy_after(code: str, **environ: str) -> dict[str, str | None]:
    """The two variables in a fresh interpreter, started with ``environ`` for them, after
    it runs ``code``."""
    env = {k: v for k, v in os.environ.items() if k not in POLICY_VARIABLES} | environ
    probe = (f"{code}\nimport json, os\n"
             f"print(json.dumps({{k: os.environ.get(k) for k in {POLICY_VARIABLES!r}}}))")
    result = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=120, check=True)
    return json.loads(result.stdout.splitlines()[-1])


def test_short_spin_is_set_when_the_user_chose_nothing():
    environ: dict[str, str] = {}
    apply_openmp_policy(environ)
    assert environ == {"GOMP_SPINCOUNT": SHORT_SPIN_COUNT}


@pytest.mark.parametrize("chosen", [{"OMP_WAIT_POLICY": "PASSIVE"},
                                    {"OMP_WAIT_POLICY": "active"},
                                    {"GOMP_SPINCOUNT": "0"}])
def test_users_own_policy_wins(chosen):
    environ = dict(chosen)
    apply_openmp_policy(environ)
    assert environ == chosen


def test_importing_radixlm_applies_the_policy_before_torch():
    code = "import sys, radixlm\nassert 'torch' not in sys.modules"
    assert policy_after(code) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": SHORT_SPIN_COUNT}
    assert policy_after(code, OMP_WAIT_POLICY="PASSIVE") == {"OMP_WAIT_POLICY": "PASSIVE",
                                                             "GOMP_SPINCOUNT": None}


def test_cli_keeps_the_packages_policy():
    code = ("from radixlm import cli\ntry:\n    cli.main(['serve', '--help'])\n"
            "except SystemExit:\n    pass")
    assert policy_after(code) == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": SHORT_SPIN_COUNT}
