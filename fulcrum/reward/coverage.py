"""Before a run: does a scorer score every row of the training and validation files?

`unscored_problems(cfg)` reads the `data_source` and `reward_model` columns of `data.train_files` and
`data.val_files` and returns (key, message) per problem, the message naming the file and the data
source or row: a data source no built-in scorer covers (when no custom_reward_function and no reward model
is set), a scorer whose optional extra is not installed, a ground truth of a text family that is not
an answer string (a float such as 72.0 reads as "72.0" and never matches), code to run where no jail
can be built. `fulcrum doctor` and
`fulcrum train` both run it before any model loads.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from typing import Any

from fulcrum.reward.sources import (
    CODE,
    MATH_VERIFY,
    NUMINA,
    GroundTruthError,
    UnscoredSource,
    configured_family,
    text_ground_truth,
)

# family -> (modules it imports, the extra that installs them)
EXTRAS = {
    NUMINA: (("sympy", "pylatexenc"), "math"),
    MATH_VERIFY: (("math_verify", "latex2sympy2_extended"), "math"),
}
MAX_ROWS_NAMED = 3


def _files(files: Any) -> list[str]:
    return [files] if isinstance(files, str) else list(files or [])


def _columns(name: str) -> tuple[list[Any], list[Any]] | None:
    """(data_source, ground_truth) per row; None when the file or its columns do not read (the doctor's
    file checks name that)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(os.path.expanduser(name), columns=["data_source", "reward_model"])
    except Exception:  # pyarrow raises several types for a missing file, a bad file or a missing column
        return None
    sources = table.column("data_source").to_pylist()
    rewards = table.column("reward_model").to_pylist()
    truths = [r.get("ground_truth") if isinstance(r, dict) else None for r in rewards]
    return sources, truths


def _missing_modules(modules: tuple[str, ...]) -> list[str]:
    return [m for m in modules if importlib.util.find_spec(m) is None]


def file_problems(name: str, options: dict[str, Any], builtin: bool) -> list[str]:
    """The problems of one data file (see the module docstring); `builtin`: the built-in scorers score it."""
    columns = _columns(name)
    if columns is None or not builtin:
        return []
    return source_problems(name, *columns, options)


def source_problems(name: str, sources: list[Any], truths: list[Any], options: dict[str, Any]) -> list[str]:
    """The problems of the built-in scorers with the rows (data_source, ground_truth) of file `name`."""
    problems = []
    for source, count in Counter(sources).items():
        first = sources.index(source)
        try:
            family = configured_family(str(source), options)
        except UnscoredSource as err:
            problems.append(f"{name}: {count} row(s) from row {first}: {err}")
            continue
        if family in EXTRAS:
            modules, extra = EXTRAS[family]
            missing = _missing_modules(modules)
            if missing:
                problems.append(
                    f"{name}: data_source {source!r} is scored by {family.scorer}, which needs "
                    f"{', '.join(missing)} (not installed): pip install 'fulcrum[{extra}]'"
                )
        if family is CODE:
            from fulcrum.sandbox import jail_problem

            problem = jail_problem()
            if problem:
                problems.append(
                    f"{name}: data_source {source!r} runs model-written code in the jail: {problem}"
                )
        if family.text_truth:
            bad = []
            for row, (s, truth) in enumerate(zip(sources, truths, strict=True)):
                if s != source:
                    continue
                try:
                    text_ground_truth(truth, str(source))
                except GroundTruthError:
                    bad.append(row)
            if bad:
                shown = ", ".join(str(r) for r in bad[:MAX_ROWS_NAMED]) + (
                    ", ..." if len(bad) > MAX_ROWS_NAMED else ""
                )
                problems.append(
                    f"{name}: row(s) {shown} ({len(bad)} in all) of data_source {source!r}: "
                    f"reward_model.ground_truth {truths[bad[0]]!r} is a {type(truths[bad[0]]).__name__}; "
                    'write it as a string ("72", as verl\'s preprocessing does)'
                )
    return problems


def unscored_problems(cfg: Any) -> list[tuple[str, str]]:
    """(key, message) for every problem of the configuration's data files; [] when all is scored."""
    from fulcrum.reward.managers import builtin_options

    builtin = not cfg.custom_reward_function.path and not cfg.reward_model.enable
    options = builtin_options(cfg.reward_model)
    problems = []
    for key in ("data.train_files", "data.val_files"):
        for name in _files(getattr(cfg.data, key.split(".")[1])):
            problems += [(key, message) for message in file_problems(name, options, builtin)]
    return problems
