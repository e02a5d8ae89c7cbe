"""The projections a LoRA adapter may adapt, by their checkpoint names (no torch here: the
options' checks read them)."""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The dense decoder's projections (and MoE models' attention ones)."""
