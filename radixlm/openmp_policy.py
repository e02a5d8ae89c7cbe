"""The OpenMP wait policy of every radixlm process, set before torch loads.

Torch's OpenMP threads (libgomp) wait for the next op by spinning. libgomp's default spin
is long enough to starve a neighbour on a small shared CPU; not spinning at all
(``OMP_WAIT_POLICY=PASSIVE``) makes each of a decode step's thousand ops wake the other
threads, and decodes slower (``benchmarks/RESULTS.md``). A short spin keeps the threads
awake within a forward pass and asleep between passes; the runner's thread policy
(``model_executor/thread_policy.py``) drops to one thread while the other cores are busy.

The user's own ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` always wins. The policy is applied
by ``import radixlm`` (every radixlm process imports the package before torch) and
inherited through the environment by the runtime's child processes.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SHORT_SPIN_COUNT = "30000"
"""libgomp's spins before a waiting thread sleeps (its default is 300,000)."""


def apply_openmp_policy(environ: MutableMapping[str, str] = os.environ) -> None:
    """Sets the short spin in ``environ`` unless the user chose a wait policy or spin count.

    Only takes effect before libgomp loads (with torch), which reads it once."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return
    environ["GOMP_SPINCOUNT"] = SHORT_SPIN_COUNT
