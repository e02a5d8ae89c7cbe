"""radixlm: a structured-generation runtime for LLMs, in the line of SGLang."""

import os

# Torch's OpenMP threads (libgomp) wait for the next op by spinning, by default for long
# enough to starve a neighbour on a small shared CPU; not spinning at all (a passive wait
# policy) makes each of a decode step's thousand ops wake the other thread (a short spin
# decodes 23-38% faster on two cores). A short spin keeps them awake within a pass and
# asleep between passes; the runner's thread policy drops to one thread while the other
# core is busy. The user's OMP_WAIT_POLICY or GOMP_SPINCOUNT win. Set before torch loads
# (and inherited by the runtime's processes).
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from radixlm.frontend_lang import *  # noqa: E402, F403 - the DSL's public names
from radixlm.frontend_lang import __all__ as _frontend_names  # noqa: E402
from radixlm.runtime.engine.engine import Engine  # noqa: E402
from radixlm.runtime.server_args import ServerArgs  # noqa: E402

__all__ = ["Engine", "ServerArgs", *_frontend_names]
__version__ = "0.1.0"
