"""Which tensors a GGUF file must hold for the model its metadata describes, and what is wrong when it does not.

transformers' GGUF loader maps each file tensor to a model weight by name and skips what it cannot place:
a weight the file lacks keeps its random initialisation, a tensor the model has no place for (a layer beyond
`block_count`, llama.cpp's `rope_freqs`) is dropped, and the model loads "successfully". An import must
instead hold exactly the weights the architecture needs, each with its shape, so a missing, left-over or
misshapen tensor (a file labelled with the wrong `general.architecture` among them) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# transformers' GGUF model_type -> gguf-py's architecture name, where they differ.
GGUF_ARCH_NAMES = {"gemma3_text": "gemma3"}


@dataclass(frozen=True)
class Needed:
    """One model weight as the file must hold it: its GGUF name, Hugging Face name and GGUF shape
    (llama.cpp's `ne` order: the Hugging Face shape reversed)."""

    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]


def needed_tensors(config: Any) -> tuple[list[Needed], list[str]]:
    """The weights a model built from `config` loads from a GGUF file, and the model weights with no GGUF
    name (a weight the file can never provide).

    Built on the meta device: no memory for the weights. A weight tied to another (the output head tied to
    the embedding) is needed once, under the first name that holds it."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model_type = GGUF_ARCH_NAMES.get(config.model_type, config.model_type)
    arch = next(key for key, value in MODEL_ARCH_NAMES.items() if value == model_type)
    names = get_tensor_name_map(arch, config.num_hidden_layers)
    needed: list[Needed] = []
    unnamed: list[str] = []
    seen: set[int] = set()
    for hf_name, param in model.state_dict(keep_vars=True).items():
        if id(param) in seen:
            continue
        seen.add(id(param))
        base, dot, suffix = hf_name.rpartition(".")
        gguf_base = names.get_name(base) if suffix in ("weight", "bias") else None
        if gguf_base is None:
            unnamed.append(hf_name)
            continue
        needed.append(Needed(f"{gguf_base}{dot}{suffix}", hf_name, tuple(reversed(param.shape))))
    return needed, unnamed


def tensor_problem(
    held: dict[str, tuple[int, ...]], needed: list[Needed], unnamed: list[str], architecture: str
) -> str | None:
    """Why the file's tensors `held` (GGUF name -> shape) do not make the model (None when they do): the
    first missing, left-over or misshapen tensor by name, with how many of each kind."""
    wanted = {n.gguf_name: n for n in needed}
    missing = [n for n in needed if n.gguf_name not in held]
    extra = [name for name in held if name not in wanted]
    misshapen = [n for n in needed if n.gguf_name in held and tuple(held[n.gguf_name]) != n.shape]
    problems = []
    if unnamed:
        problems.append(f"the {architecture} model's weight {unnamed[0]} has no GGUF name")
    if missing:
        first = missing[0]
        problems.append(
            f"{len(missing)} tensor(s) missing, first {first.gguf_name} ({first.hf_name} of a {architecture} model)"
        )
    if extra:
        problems.append(
            f"{len(extra)} tensor(s) a {architecture} model of this size has no place for, first {extra[0]}"
        )
    if misshapen:
        first = misshapen[0]
        problems.append(
            f"{len(misshapen)} tensor(s) of the wrong shape, first {first.gguf_name} "
            f"{list(held[first.gguf_name])} where a {architecture} model needs {list(first.shape)}"
        )
    if not problems:
        return None
    return "; ".join(problems) + " (is general.architecture right? nothing written)"
