"""Interactions by class path, verl's interaction-config YAML, and which interaction a row uses.

An interaction config lists interactions as verl's does
(`actor_rollout_ref.rollout.multi_turn.interaction_config_path`):

    interaction:
      - name: gsm8k                                            # optional: from the class name
        class_name: verl.interactions.gsm8k_interaction.Gsm8kInteraction
        config: {}                                             # given to the constructor, with name

Without `name`, verl's rule names the entry: the class name less a trailing `Interaction`, lower-cased
(`Gsm8kInteraction` → `gsm8k`); names must differ. verl's built-in class names map to fulcrum's
(VERL_INTERACTIONS); any other `verl.` class is refused, since verl itself is not installed. Every error
names the file, the entry's index and the key. A row picks its interaction by
`extra_info.interaction_kwargs.name`, which verl's tool agent loop requires.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from fulcrum.agent.class_path import import_class
from fulcrum.agent.interaction import BaseInteraction

KEY = "actor_rollout_ref.rollout.multi_turn.interaction_config_path"
GSM8K_INTERACTION = "fulcrum.agent.gsm8k_interaction.Gsm8kInteraction"
BASE_INTERACTION = "fulcrum.agent.interaction.BaseInteraction"

# verl class path → fulcrum class path.
VERL_INTERACTIONS: dict[str, str] = {
    "verl.interactions.gsm8k_interaction.Gsm8kInteraction": GSM8K_INTERACTION,
    "verl.interactions.base.BaseInteraction": BASE_INTERACTION,
}
ENTRY_KEYS = ("name", "class_name", "config")


class InteractionConfigError(ValueError):
    """An interaction config that cannot be used; the message names the file, the entry and the key."""


def offered() -> str:
    """What fulcrum offers instead of an unknown verl interaction, in one phrase."""
    mapped = ", ".join(f"{verl} (→ {ours})" for verl, ours in VERL_INTERACTIONS.items())
    return f"fulcrum provides {mapped}; or subclass {BASE_INTERACTION} and give its class path"


def resolve_interaction_class(class_name: str, where: str) -> type[BaseInteraction]:
    """The interaction class named `class_name` (`package.module.Class`, or one of verl's built-ins)."""
    if class_name.startswith("verl.") and class_name not in VERL_INTERACTIONS:
        raise InteractionConfigError(
            f"{where}: {class_name} is a verl interaction fulcrum has no counterpart for; {offered()}"
        )
    cls = import_class(VERL_INTERACTIONS.get(class_name, class_name), where, InteractionConfigError)
    if not (isinstance(cls, type) and issubclass(cls, BaseInteraction)):
        raise InteractionConfigError(f"{where}: {class_name} is not a subclass of {BASE_INTERACTION}")
    return cls


def default_name(class_name: str) -> str:
    """verl's name for an entry without one: the class name less `Interaction`, lower-cased."""
    simple = class_name.rpartition(".")[2]
    return (simple[: -len("Interaction")] if simple.endswith("Interaction") else simple).lower()


def read_entries(path: str | Path) -> tuple[Path, list[Any]]:
    """The file and its `interaction:` list, or an InteractionConfigError naming what is wrong."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise InteractionConfigError(f"{KEY}: no such file {file}")
    try:
        raw = OmegaConf.to_container(OmegaConf.load(file), resolve=True)
    except Exception as err:
        raise InteractionConfigError(f"{file}: not a readable YAML file: {err}") from err
    if not isinstance(raw, dict) or not isinstance(raw.get("interaction"), list):
        raise InteractionConfigError(f"{file}: expected a top-level `interaction:` list")
    return file, raw["interaction"]


def check_entry(entry: Any, where: str) -> tuple[str, str, dict[str, Any]]:
    """(name, class_name, config) of one `interaction[i]` entry, its keys checked, nothing imported."""
    if not isinstance(entry, dict):
        raise InteractionConfigError(
            f"{where}: expected a mapping with name, class_name, config; got {entry!r}"
        )
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise InteractionConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(ENTRY_KEYS)}"
        )
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise InteractionConfigError(
            f"{where}.class_name: required, a class path such as {GSM8K_INTERACTION}"
        )
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise InteractionConfigError(f"{where}.config: expected a mapping, got {config!r}")
    name = entry.get("name")
    if name is None:
        name = default_name(class_name)
    if not isinstance(name, str) or not name:
        raise InteractionConfigError(f"{where}.name: expected a non-empty string, got {name!r}")
    return name, class_name, dict(config)


def check_names(file: Path, entries: list[Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """Every entry checked; a name given twice is an error naming both entries."""
    checked, first_index = [], {}
    for index, entry in enumerate(entries):
        name, class_name, config = check_entry(entry, f"{file}: interaction[{index}]")
        if name in first_index:
            raise InteractionConfigError(
                f"{file}: interaction[{index}].name: {name!r} is already the name of "
                f"interaction[{first_index[name]}]; rows pick an interaction by name, so names must differ"
            )
        first_index[name] = index
        checked.append((name, class_name, config))
    return checked


def load_interaction_config(path: str | Path) -> dict[str, BaseInteraction]:
    """The interactions of a verl interaction-config file by name, each built once."""
    file, entries = read_entries(path)
    interactions: dict[str, BaseInteraction] = {}
    for index, (name, class_name, config) in enumerate(check_names(file, entries)):
        where = f"{file}: interaction[{index}]"
        cls = resolve_interaction_class(class_name, f"{where}.class_name")
        try:
            interactions[name] = cls(config={**config, "name": name})
        except Exception as err:
            raise InteractionConfigError(f"{where} ({class_name}): the constructor raised {err!r}") from err
    return interactions


def config_problems(path: str | Path) -> list[str]:
    """What is wrong with an interaction-config file without importing its classes (for `fulcrum
    doctor`, which never runs user code): [] when its entries are well formed."""
    try:
        file, entries = read_entries(path)
        if not entries:
            return [f"{file}: the `interaction:` list is empty"]
        for index, (_, class_name, _) in enumerate(check_names(file, entries)):
            if class_name.startswith("verl.") and class_name not in VERL_INTERACTIONS:
                resolve_interaction_class(class_name, f"{file}: interaction[{index}].class_name")
    except InteractionConfigError as err:
        return [str(err)]
    return []


def pick_interaction(
    interactions: dict[str, BaseInteraction], interaction_kwargs: dict[str, Any], row: str
) -> BaseInteraction:
    """The interaction a row names in `extra_info.interaction_kwargs.name`, as verl's loop picks it."""
    name = interaction_kwargs.get("name")
    if name is None:
        raise ValueError(
            f"data row {row}: extra_info.interaction_kwargs has no 'name', which picks the interaction "
            f"when {KEY} is set (interactions: {', '.join(interactions)})"
        )
    if name not in interactions:
        raise ValueError(
            f"data row {row}: extra_info.interaction_kwargs.name {name!r} is not in the interaction config "
            f"(interactions: {', '.join(interactions)})"
        )
    return interactions[name]
