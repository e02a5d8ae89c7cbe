"""The process-wide switches that decide which kernels a CPU forward pass runs, read and
set as one value, so that the test fixtures can hand every test the same process: a test
that turns the fused kernels on or leaves a thread count behind must not change what a
later test computes.

(What the switches are is the runtime's business: ``fused_ops``' on/off, huge pages,
torch's thread count and oneDNN switch; the kernel choices are each runner's own plan. A
process serves with one setting of each; only a test process meets several.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixlm.kernels.cpu_ops import fused_ops, huge_pages


@dataclass(frozen=True)
class ProcessSettings:
    fused_kernels: bool
    huge_pages: bool
    threads: int
    onednn: bool

    @classmethod
    def now(cls) -> ProcessSettings:
        huge = huge_pages.enable(True)
        huge_pages.enable(huge)
        return cls(fused_kernels=fused_ops.active() is not None,
                   huge_pages=huge, threads=torch.get_num_threads(),
                   onednn=torch.backends.mkldnn.enabled)

    def apply(self) -> None:
        """Sets every switch to this value (the fused kernels come on only where they built)."""
        if self.fused_kernels:
            fused_ops.enable()
        else:
            fused_ops.disable()
        huge_pages.enable(self.huge_pages)
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        torch.backends.mkldnn.enabled = self.onednn
