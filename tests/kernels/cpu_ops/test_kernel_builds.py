"""How the fused CPU kernels are built (fused_ops.py): the constants Python shares with the
sources reach them as -D flags, and a new build removes the earlier ones it can lock."""

from __future__ import annotations

from pathlib import Path

from radixlm.kernels.cpu_ops import fused_ops


def test_every_projection_kernel_reaches_the_sources_as_a_define():
    defines = fused_ops.compile_defines()
    projections = Path(fused_ops.__file__).with_name("decode_projection.h").read_text()
    for kernel in fused_ops.ProjectionKernel:
        assert f"-DRADIXLM_PROJECTION_{kernel.name}={kernel.value}" in defines
        assert f"RADIXLM_PROJECTION_{kernel.name}," in projections  # an enumerator's value
    for name, dim in [("BFLOAT16", 128), ("FLOAT32", 256)]:
        assert f"-DRADIXLM_PREFILL_MAX_VALUE_DIM_{name}={dim}" in defines
    assert f"-DRADIXLM_PAIR_COLUMNS={fused_ops.PAIR_COLUMNS}" in defines
    assert f"-DRADIXLM_BLOCK_COLUMNS={fused_ops.BLOCK_COLUMNS}" in defines


def test_the_column_layouts_use_the_kernels_widths():
    from radixlm.models.layers import column_layouts

    assert column_layouts.PAIR_COLUMNS is fused_ops.PAIR_COLUMNS
    assert column_layouts.BLOCK_COLUMNS is fused_ops.BLOCK_COLUMNS


def test_a_new_build_removes_the_unused_ones_but_a_locked_or_recent_one(tmp_path):
    """Builds unused for OLD_BUILD_DAYS go; one another environment loaded lately (another
    torch or CPU sharing the directory) and one being built now stay."""
    import fcntl
    import os
    import time

    builds = {name: tmp_path / f"{fused_ops.BUILD_PREFIX}{name}"
              for name in ("current", "old", "building", "recent")}
    long_ago = time.time() - (fused_ops.OLD_BUILD_DAYS + 1) * 86400
    for name, directory in builds.items():
        directory.mkdir()
        (directory / "module.so").write_text("")
        (directory / "radixlm.lock").write_text("")
        if name != "recent":
            os.utime(directory / "radixlm.lock", (long_ago, long_ago))
    unrelated = tmp_path / "another_extension"
    unrelated.mkdir()
    with open(builds["building"] / "radixlm.lock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX)  # another builder's turn
        fused_ops._remove_old_builds(tmp_path, keep=builds["current"])
    assert not builds["old"].exists()
    assert all((builds[name] / "module.so").exists() for name in ("current", "building", "recent"))
    assert unrelated.exists()
