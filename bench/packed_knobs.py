"""The compiled training path's settings (`fulcrum.models.packed`) as command-line flags, for the benches
that compare them: `bench/train_step.py` and `bench/passes.py`.

Unset flags leave the tree's defaults. Both scripts also measure older trees through PYTHONPATH, where
some of these settings do not exist yet: setting one there is harmless, and `knob_summary` reads them
with their absence in mind.
"""

from __future__ import annotations

import argparse


def add_packed_knobs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers-per-region",
        type=int,
        default=None,
        help="decoder layers per compiled region (fulcrum.models.packed.LAYERS_PER_REGION), to compare",
    )
    parser.add_argument(
        "--save-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="checkpointing also keeps the attention kernel's outputs (packed.SAVE_ATTENTION_OUTPUTS, on by "
        "default), to compare",
    )
    parser.add_argument(
        "--save-mlp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="checkpointing also keeps the MLP's gate and up projections' outputs (packed.SAVE_MLP_PROJECTIONS, "
        "off by default), to compare",
    )


def apply_packed_knobs(args: argparse.Namespace) -> None:
    """Set the flags that were given on `fulcrum.models.packed`, before any worker compiles."""
    from fulcrum.models import packed

    if args.layers_per_region:
        packed.LAYERS_PER_REGION = args.layers_per_region
    if args.save_attention is not None:
        packed.SAVE_ATTENTION_OUTPUTS = args.save_attention
    if args.save_mlp is not None:
        packed.SAVE_MLP_PROJECTIONS = args.save_mlp


def knob_summary() -> dict[str, object]:
    """The settings the run used (None where this tree has no such setting)."""
    from fulcrum.models import packed

    compile_options = getattr(packed, "compile_options", None)
    return {
        "layers_per_region": getattr(packed, "LAYERS_PER_REGION", None),
        "save_attention": getattr(packed, "SAVE_ATTENTION_OUTPUTS", None),
        "save_mlp": getattr(packed, "SAVE_MLP_PROJECTIONS", None),
        "cpp_wrapper": bool((compile_options() or {}).get("cpp_wrapper"))
        if compile_options is not None
        else None,
    }
