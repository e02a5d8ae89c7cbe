"""Fixtures of the KV cache tests."""

from __future__ import annotations

import pytest
from hierarchical_rig import Rig


@pytest.fixture
def make_rig():
    """Builds rigs; after the test, each one's accounting must balance, its locks released."""
    rigs: list[Rig] = []

    def make(**options) -> Rig:
        rig = Rig(**options)
        rigs.append(rig)
        return rig

    yield make
    for rig in rigs:
        rig.check_accounting()
        for node in rig.locked:
            rig.cache.dec_lock_ref(node)
        rig.locked.clear()
        rig.check_accounting()
        rig.cache.close()
