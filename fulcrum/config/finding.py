"""What a check reports, one type for the configuration's rules, `fulcrum doctor`'s lever rules and a
run's diagnosis (fulcrum.trainer.diagnosis): the configuration is the lowest layer that reports them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Finding:
    """One finding: the key(s) it concerns and what is wrong or worth knowing; `severity` "error" (the run
    fails or wastes compute), "warning" (it runs) or "info" (how it spends its time). `why` and `fix` (the
    lever to pull) explain it; a run's diagnosis also names its `rule` and the `step` where it first showed."""

    keys: tuple[str, ...]
    message: str
    severity: str = "error"
    why: str = ""
    fix: str = ""
    rule: str = ""
    step: int | None = None

    def __str__(self) -> str:
        return f"{', '.join(self.keys)}: {self.message}" if self.keys else self.message

    def lines(self) -> list[str]:
        """`fulcrum doctor`'s block: the statement, then the keys, why and fix under it."""
        under = (("keys:", ", ".join(self.keys)), ("why: ", self.why), ("fix: ", self.fix))
        return [f"{self.severity}: {self.message}"] + [f"    {label} {text}" for label, text in under if text]

    def one_line(self) -> str:
        """A run's diagnosis as the trainer prints it."""
        where = f"step {self.step}: " if self.step is not None else ""
        return f"diagnosis ({self.rule}) {where}{self.message} -> {self.fix}"
