"""bench/learning.py's lever variants: named sets of `fulcrum train` overrides, one RL run each, all from
the same warm start in one device call, in place of the algorithms x seeds grid.

    python bench/learning.py --out /tmp/learning --variants levers            # the built-in set below
    python bench/learning.py --out /tmp/learning --variants \\
        grpo-lr3e-5=algorithm.adv_estimator=grpo,actor_rollout_ref.actor.optim.lr=3e-5 \\
        ppo-clr1e-5=algorithm.adv_estimator=gae,critic.optim.lr=1e-5

A variant is `NAME=KEY=VALUE[,KEY=VALUE...]`: its name (the run's folder `rl/NAME` and its label in the
summary and the curves), then overrides laid over the plan's own (`rl_overrides`: a key both set takes
the variant's value); `algorithm.adv_estimator` (gae or grpo) must be among them. A comma followed by
`KEY=` starts the next override, so list values such as `trainer.logger=[console,tensorboard]` survive.

LEVERS (`--variants levers`) answers docs/levers.md's learning-lever questions within the six processes
one card holds (bench/learning.py's MEMORY). What 2026-11-30's grid run (PPO and GRPO x 3 seeds, actor
lr 1e-4, KL coefficient 0.001, grad_clip 1.0) left open, and why each variant is where it is:

- GRPO gained less than PPO (+0.246 +/- 0.085 against +0.389 +/- 0.039) with KL spikes (to 0.28) at
  its accuracy drops, so five of the six runs are GRPO and each pulls one lever against them;
- `grpo-baseline` (the plan's settings) is the same-call reference: the warm start is made again in
  every call (a fresh device machine) and the six runs share the card differently than the grid's
  three-and-three, so today's figures are not a clean baseline; one seed of it, though, so a
  difference smaller than GRPO's seed spread (0.085 in final accuracy) is not a finding;
- actor lr 3e-5 and 3e-4 (`grpo-lr3e-5`, `grpo-lr3e-4`): a half-decade either side of the first
  guess, 1e-4 -- slower and steadier, or faster and less stable;
- KL coefficient 0.1 (`grpo-kl0.1`), 100x the plan's: at 0.001 the KL term added ~5e-5 to the loss
  (KL ~0.05), and one seed cannot resolve the small effect 10x would have, so the variant sits where
  the lever should show if it does anything at this scale; 0.01 is one `--variants` entry away;
- grad_clip 0.3 (`grpo-clip0.3`): the pre-clip `actor/grad_norm` had a median of 0.23 and exceeded the
  default 1.0 in 3 of 588 GRPO steps (1 of 320 PPO steps), so clipping at 1.0 did nothing; at 0.3 it
  clips the quarter of the steps above it (139 of 588), spikes included, and leaves the typical step
  alone -- the setting a user reading `actor/grad_norm` would try;
- critic lr 1e-5, verl's default (`ppo-critic-lr1e-5`), against the plan's 1e-4 for PPO's fresh value
  head: its signal is the critic's explained variance, which reached 0.22-0.31 in all three of
  today's PPO seeds at 1e-4 and is compared with those (PPO's seed spread, 0.039, is small).

Memory: five GRPO runs and one PPO run: 5 x 13.7 + 17.3 + 1 = 87 GiB <= 100 (MEMORY's figures).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MAX_RUNS = 6  # processes one H200 holds side by side (bench/learning.py's MEMORY)
ALGORITHM_KEY = "algorithm.adv_estimator"
ALGORITHMS = ("gae", "grpo")

_GRPO, _PPO = f"{ALGORITHM_KEY}=grpo", f"{ALGORITHM_KEY}=gae"
LEVERS: dict[str, tuple[str, ...]] = {
    "grpo-baseline": (_GRPO,),
    "grpo-lr3e-5": (_GRPO, "actor_rollout_ref.actor.optim.lr=3e-5"),
    "grpo-lr3e-4": (_GRPO, "actor_rollout_ref.actor.optim.lr=3e-4"),
    "grpo-kl0.1": (_GRPO, "actor_rollout_ref.actor.kl_loss_coef=0.1"),
    "grpo-clip0.3": (_GRPO, "actor_rollout_ref.actor.grad_clip=0.3"),
    "ppo-critic-lr1e-5": (_PPO, "critic.optim.lr=1e-5"),
}
BUILT_IN = {"levers": LEVERS}

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
_NEXT_OVERRIDE = re.compile(r",(?=[+~]?[A-Za-z_][\w.]*=)")  # a comma that starts the next KEY=VALUE


@dataclass(frozen=True)
class Variant:
    name: str
    algo: str  # gae or grpo: the plan sizes the run by it (n, prompts a step)
    overrides: tuple[str, ...]


def override_key(text: str) -> str:
    """`KEY` of `KEY=VALUE` (a leading + or ~, Hydra's add/delete marks, dropped)."""
    return text.split("=", 1)[0].strip().lstrip("+~")


def _variant(name: str, overrides: tuple[str, ...], spec: str) -> Variant:
    if not _NAME.fullmatch(name):
        raise ValueError(
            f"--variants {spec!r}: the name {name!r} must be letters, digits, '.', '_', '+', '-'"
        )
    for text in overrides:
        if "=" not in text or not override_key(text):
            raise ValueError(f"--variants {name}: {text!r} is not KEY=VALUE")
    algos = [text.split("=", 1)[1].strip() for text in overrides if override_key(text) == ALGORITHM_KEY]
    if not algos:
        raise ValueError(f"--variants {name}: give its algorithm, {ALGORITHM_KEY}=gae or =grpo")
    if algos[-1] not in ALGORITHMS:
        raise ValueError(f"--variants {name}: {ALGORITHM_KEY}={algos[-1]}: this benchmark runs gae or grpo")
    return Variant(name, algos[-1], overrides)


def parse_variants(specs: list[str]) -> list[Variant]:
    """Variants from `NAME=KEY=VALUE[,KEY=VALUE...]` arguments or built-in set names (`levers`);
    ValueError naming the argument when one is malformed, names repeat or there are more than MAX_RUNS."""
    variants: list[Variant] = []
    for spec in specs:
        if spec in BUILT_IN:
            variants += [_variant(name, o, spec) for name, o in BUILT_IN[spec].items()]
            continue
        name, sep, rest = spec.partition("=")
        if not sep or "=" not in rest:
            raise ValueError(
                f"--variants {spec!r} is not NAME=KEY=VALUE[,KEY=VALUE...] nor one of {sorted(BUILT_IN)}; "
                "KEY=VALUE arguments for every run go before --variants"
            )
        variants.append(_variant(name, tuple(t.strip() for t in _NEXT_OVERRIDE.split(rest)), spec))
    names = [v.name for v in variants]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"--variants: the name(s) {', '.join(repeated)} appear more than once")
    if len(variants) > MAX_RUNS:
        raise ValueError(
            f"--variants: {len(variants)} runs, at most {MAX_RUNS} fit one H200 side by side "
            "(bench/learning.py's MEMORY); split them over two calls"
        )
    return variants


def check_overrides(variants: list[Variant]) -> None:
    """Each variant's overrides through fulcrum's own loader, so a misspelt key or a bad value stops
    the benchmark before its minutes of warm start rather than when the run starts."""
    from fulcrum.config import ConfigError, load_config

    for v in variants:
        try:
            load_config(list(v.overrides))
        except ConfigError as err:
            raise ValueError(f"--variants {v.name}: {err}") from None


def merge_overrides(base: list[str], changes: tuple[str, ...] | list[str]) -> list[str]:
    """`base` with each of `changes` in place of the entry with the same key, the others appended;
    the command line then says each key once, with the value the run uses."""
    merged = list(base)
    position = {override_key(text): i for i, text in enumerate(merged)}
    for text in changes:
        key = override_key(text)
        if key in position:
            merged[position[key]] = text
        else:
            position[key] = len(merged)
            merged.append(text)
    return merged


SEED_KEY = "trainer.seed"


def variant_seed(variant: Variant, default: int) -> int:
    """The variant's own `trainer.seed` (its last), or `default`."""
    seeds = [text.split("=", 1)[1].strip() for text in variant.overrides if override_key(text) == SEED_KEY]
    return int(seeds[-1]) if seeds else default


def without_seed(overrides: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """The overrides less `trainer.seed`: variants that agree on these are seeds of one setting."""
    return tuple(text for text in overrides if override_key(text) != SEED_KEY)
