"""The values each numeric key accepts (its domain), declared beside the key and checked in one pass.

A domain is an interval, written as in maths (`> 0`, `in (0, 1]`), plus single sentinel values that
mean "off" (`-1`). Every `int`/`float` field of the key tree declares one (`opt(default, help, domain)`
in fulcrum.config.schema); `domain_problems(cfg)` (fulcrum.config.validate_domains) walks the tree and
names each value outside, with the key, the value and the domain. `fulcrum train` and `fulcrum doctor`
both run it through `fulcrum.config.validate`, before any model loads. A key whose type also allows
null accepts null (it then follows another key, or means "not set"). Non-finite numbers are outside
every domain: an `inf` learning rate or clip ratio is never meant.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

DOMAIN = "domain"  # the field metadata entry holding a numeric key's Domain


@dataclass(frozen=True)
class Domain:
    """Finite numbers between `low` and `high` (open ends excluded), or one of `also` (sentinels)."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()

    def __contains__(self, value: float) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return above and below

    def __str__(self) -> str:
        """`> 0`, `>= 1 or -1`, `in (0, 1]`, `any number`."""
        if math.isinf(self.low) and math.isinf(self.high):
            text = "any number"
        elif math.isinf(self.high):
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        elif math.isinf(self.low):
            text = f"{'<' if self.high_open else '<='} {_number(self.high)}"
        else:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_number(self.low)}, {_number(self.high)}{right}"
        return " or ".join([text, *(_number(v) for v in self.also)])


def _number(value: float) -> str:
    """1.0 -> '1', 0.5 -> '0.5', 4294967295 -> '4294967295'."""
    return str(int(value)) if float(value).is_integer() else str(value)


# The domains most keys share; a key with its own bounds writes Domain(...) in place.
ANY_NUMBER = Domain()  # said explicitly, so that "no bound" is a decision and not an omission
ABOVE_0 = Domain(0, low_open=True)  # coefficients that divide, clip ranges, gradient norms
AT_LEAST_0 = Domain(0)  # coefficients, learning rates, counts where 0 means none
AT_LEAST_1 = Domain(1)  # sizes and counts of things that must exist
FRACTION = Domain(0, 1)  # [0, 1]: ratios, discount factors
SHARE = Domain(0, 1, low_open=True)  # (0, 1]: top_p, memory fractions, token fractions
SEED = Domain(0, 2**32 - 1)  # numpy's and torch's seed range
SIZE_OR_AUTO = Domain(1, also=(-1,))  # a size, or -1: chosen for you
OFF_OR_COUNT = Domain(-1)  # a count where -1 and 0 mean off, as in verl (top_k, save_freq, ...)


def domain_of(field: dataclasses.Field) -> Domain | None:
    """The domain a config field declares (None for a field that is not a number)."""
    return field.metadata.get(DOMAIN)
