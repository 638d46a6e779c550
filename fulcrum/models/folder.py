"""What a model path must be before anything is loaded: where it lives, and whether the folder is whole.

`resolve_model_path` decides local or Hub once: a path that exists, or looks like a path, is a local
folder; anything else is a Hub id, tried once with a short network probe (never a minute of
retries). `model_folder_problems` reads only small files and weight-file headers, so `fulcrum
doctor` and the trainer's set-up can name a missing tokenizer, chat template, or a truncated
safetensors file without loading weights.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from pathlib import Path
from urllib.parse import urlparse

from fulcrum.config import FulcrumConfig, uses_critic, uses_reference

HUB_PROBE_TIMEOUT_S = 3.0
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelPathError(ValueError):
    """A model path or folder that cannot be used; the message names the key, the path and what to do."""


def looks_like_path(name: str) -> bool:
    """A local path by its spelling: absolute, ~, ./ or ../, a trailing slash, or more than one slash.

    `org/name` (one slash) is also how Hub ids are written, so it counts as a Hub id unless it exists.
    """
    return name.startswith(("/", "~", ".")) or name.endswith(("/", os.sep)) or name.count("/") > 1


def _hub_reachable() -> str | None:
    """None when the Hub's host answers a TCP connection within the probe timeout; else why not."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError as exc:
        return f"no network: {host} did not answer ({exc.strerror or exc})"
    return None


def resolve_model_path(name: str, key: str) -> str:
    """`name` when it is a usable local folder, or a Hub id that is cached or reachable; else ModelPathError."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelPathError(f"{key}={name}: is a file; it must be a Hugging Face model folder")
        return str(path)
    if looks_like_path(name) or not name.strip():
        raise ModelPathError(f"{key}={name}: no such model folder (relative to {Path.cwd()})")
    from huggingface_hub import try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name  # in the local Hub cache: loads without the network
    why = _hub_reachable()
    if why is not None:
        raise ModelPathError(
            f"{key}={name}: no such local folder (relative to {Path.cwd()}), and as a Hugging Face Hub id it "
            f"is not in the cache and cannot be fetched ({why}). Give the path of a local model folder, "
            "or download the model first where there is a network."
        )
    return name


def safetensors_problem(file: Path) -> str | None:
    """Why a safetensors file is unreadable (bad header, truncated), from its header alone; None if whole."""
    size = file.stat().st_size
    if size < 8:
        return f"{file}: {size} bytes, too short for a safetensors file"
    with open(file, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            return f"{file}: header of {header_len} bytes but the file has {size} (truncated?)"
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return f"{file}: the safetensors header is not valid JSON (not a safetensors file, or damaged)"
    ends = [t["data_offsets"][1] for name, t in header.items() if name != "__metadata__"]
    expected = 8 + header_len + max(ends, default=0)
    if size < expected:
        return (
            f"{file}: {size} bytes but its header describes {expected} (truncated: copy or download it again)"
        )
    return None


def read_model_config(folder: Path) -> dict:
    """config.json of a local model folder as a dict ({} when missing or unreadable)."""
    try:
        data = json.loads((folder / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def vocab_size(folder: Path) -> int | None:
    """Rows of the model's token embedding, from config.json (None when it does not say)."""
    config = read_model_config(folder)
    value = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return int(value) if isinstance(value, int) else None


def model_folder_problems(
    name: str, key: str, needs_tokenizer: bool = False, needs_weights: bool = True
) -> list[str]:
    """What is wrong with local model folder `name` (empty: usable), without loading weights.

    Checks config.json, weight files present and their safetensors headers against their sizes,
    and with `needs_tokenizer` (the folder the prompts are tokenized with) tokenizer files and a
    chat template.
    """
    folder = Path(name).expanduser()
    if not folder.is_dir():
        return []  # a Hub id: resolve_model_path speaks for it
    problems = []
    if needs_weights:
        if not (folder / "config.json").is_file():
            problems.append(f"{key}={name}: no config.json (not a Hugging Face model folder)")
        elif not read_model_config(folder):
            problems.append(f"{key}={name}: config.json is not a valid JSON object")
        weights = sorted(folder.glob("*.safetensors"))
        if not weights and not list(folder.glob("*.bin")):
            problems.append(f"{key}={name}: no weight file (*.safetensors or *.bin)")
        problems += [f"{key}: {p}" for w in weights if (p := safetensors_problem(w))]
    if needs_tokenizer:
        if not any((folder / f).is_file() for f in TOKENIZER_FILES):
            problems.append(
                f"{key}={name}: no tokenizer (none of {', '.join(TOKENIZER_FILES)}); copy the tokenizer files "
                "of the model into the folder, or set data.tokenizer to a folder that has them"
            )
        elif not _has_chat_template(folder):
            problems.append(
                f"{key}={name}: the tokenizer has no chat template (no chat_template.jinja and no chat_template "
                "in tokenizer_config.json); RL prompts are chat messages, so add the model's template"
            )
    return problems


def _has_chat_template(folder: Path) -> bool:
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return bool(config.get("chat_template"))


def vocab_problems(token_count: int, tokenizer_key: str, models: dict[str, str]) -> list[str]:
    """Models whose embedding has fewer rows than the tokenizer has tokens (ids past the end would crash).

    `models`: key -> local folder. Embeddings may be larger (padded, as Qwen's) but not smaller.
    """
    problems = []
    for key, name in models.items():
        rows = vocab_size(Path(name).expanduser())
        if rows is not None and rows < token_count:
            problems.append(
                f"{key}={name}: its vocabulary has {rows} tokens but the tokenizer of {tokenizer_key} has "
                f"{token_count}; the models must share one tokenizer (use a model of the same family)"
            )
    return problems


def models_to_check(cfg: FulcrumConfig) -> dict[str, tuple[str, bool]]:
    """key -> (folder or Hub id as written, whether it must hold a tokenizer) of every model folder the run
    loads: the actor, and the critic, `data.tokenizer`, the reward model and the reference's own model
    when the run uses them. `fulcrum train` and `fulcrum doctor` both check exactly these."""
    models = {"actor_rollout_ref.model.path": (cfg.actor_rollout_ref.model.path, True)}
    if uses_critic(cfg):
        models["critic.model.path"] = (cfg.critic.model.path, False)
    if cfg.data.tokenizer:
        models["data.tokenizer"] = (cfg.data.tokenizer, False)
    if cfg.reward_model.enable:
        models["reward_model.model.path"] = (cfg.reward_model.model.path, True)
    ref_model = cfg.actor_rollout_ref.ref.model
    if uses_reference(cfg) and ref_model and ref_model.get("path"):
        models["actor_rollout_ref.ref.model.path"] = (ref_model["path"], False)
    return models


def models_reading_actor_ids(cfg: FulcrumConfig) -> dict[str, str]:
    """key -> folder of every model fed the actor tokenizer's ids (all of `models_to_check` but a
    separate tokenizer): each needs an embedding row for every id."""
    return {k: str(path) for k, (path, _) in models_to_check(cfg).items() if k != "data.tokenizer"}
