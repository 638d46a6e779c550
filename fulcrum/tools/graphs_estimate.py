"""Whether a role's micro-batches would replay as CUDA graphs, read from the keys alone (no torch, for
`fulcrum doctor`): `fulcrum.workers.cuda_graphs.graphs_refused`'s rule. A graphed model keeps its bf16 compute
weights and a bf16 gradient buffer resident, and every model's graphs share one memory pool
(`fulcrum.tools.memory_estimate` counts both)."""

from __future__ import annotations

from typing import Any

from fulcrum.config import world_size
from fulcrum.config.keys import get_path

GiB = 1024**3
GRAPHS_RESIDENT_SHARE = 0.05  # fulcrum.workers.cuda_graphs.MAX_RESIDENT_SHARE (a test keeps them equal)

# Each role's keys: its cuda_graphs switch, its packing switch, its sequence-parallel size.
GRAPH_ROLE_KEYS = {
    "actor": ("actor_rollout_ref.actor", "actor_rollout_ref.model", "actor_rollout_ref.actor"),
    "reference": ("actor_rollout_ref.ref", "actor_rollout_ref.model", "actor_rollout_ref.ref"),
    "critic": ("critic", "critic.model", "critic"),
}


def graphs_refused(
    cfg: Any, role: str, device_bytes: float, kept: float, lora: bool = False, linear: bool = False
) -> str | None:
    """Why `role`'s micro-batches would run eagerly, or None when they replay as CUDA graphs keeping `kept`
    bytes resident (fulcrum.workers.cuda_graphs.graphs_refused's rule, read from the keys): its
    `cuda_graphs` key on, one process, packed, no sequence parallelism, no `linear`-attention layers, no
    LoRA, `kept` within `GRAPHS_RESIDENT_SHARE` of the device (a CUDA device, as the whole estimate)."""
    switch, model, sp = (get_path(cfg, path) for path in GRAPH_ROLE_KEYS[role])
    if not switch.cuda_graphs:
        return f"{GRAPH_ROLE_KEYS[role][0]}.cuda_graphs=false"
    if world_size(cfg) > 1:
        return "several processes"
    if not model.use_remove_padding:
        return f"padded micro-batches ({GRAPH_ROLE_KEYS[role][1]}.use_remove_padding=false)"
    if int(sp.ulysses_sequence_parallel_size or 1) > 1:
        return "sequence parallelism"
    if linear:
        return "linear-attention layers"
    if lora:
        return "LoRA adapters"
    if kept > GRAPHS_RESIDENT_SHARE * device_bytes:
        return f"it would keep {kept / GiB:.1f} GiB resident, over {GRAPHS_RESIDENT_SHARE:.0%} of the device"
    return None
