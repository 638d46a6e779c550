"""A multi-step task in GSM8K's format: word problems of two to four operations, numbers carried through.

Each problem starts from one number and applies 2–4 operations (add, subtract, multiply, divide
exactly), each told by one sentence; the worked solution has one line per operation, each starting
from the previous line's result, then the answer after `####` (GSM8K's format):

    Ava has 12 coins. She finds 7 more. Then she has 3 times as many coins as before. She splits
    them equally into 3 groups and keeps one group. How many coins does Ava have now?
        12 + 7 = 19
        19 * 3 = 57
        57 / 3 = 19
        #### 19

Rows follow verl's parquet schema (`data_source` `synthetic/multistep`, chat-message `prompt`,
`reward_model.ground_truth`, `extra_info {split, index, question, answer, num_steps}`), so the GSM8K
rule-based scorer (strict mode: the last `#### N`) grades responses to it and `fulcrum sft` trains on
`extra_info.answer`. Unlike the demo's one-operation task (`fulcrum.data.synthetic`), a right answer
here needs every intermediate result right: what RL improves is the arithmetic, not the format.

Held out: no validation problem shares its question or its chain of equations with a training
problem (`write_splits`), so validation accuracy is not recall of training answers.

`python -m fulcrum.data.multistep --out DIR [--train 20000 --test 500 --dev 0 --seed 0 ...]` writes
`DIR/train.parquet` and `DIR/test.parquet` (and `DIR/dev.parquet`, held out from both, with `--dev N`).
"""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from fulcrum.data.synthetic import GSM8K_INSTRUCTION, Problem, distinct_problems, verl_row, write_parquet

DATA_SOURCE = "synthetic/multistep"
OPERATIONS = ("+", "-", "*", "/")

_NAMES = [("Mia", "she"), ("Tom", "he"), ("Ava", "she"), ("Sam", "he"), ("Lily", "she"), ("Ben", "he")]
_ITEMS = ["apples", "pears", "books", "coins", "cards", "stamps", "marbles"]
_BOXES = ["box", "bag", "jar"]

# Story kinds: an opening sentence with the first number, sentences per operation ({n}: the operand),
# a question. Placeholders: {name} {pron} {Pron} {items} {box} {n}.
_STORIES: list[dict[str, object]] = [
    {
        "intro": "{name} has {n} {items}.",
        "+": ["{Pron} buys {n} more.", "{Pron} finds {n} more.", "A friend gives {name} {n} more."],
        "-": ["{Pron} gives away {n}.", "{Pron} loses {n}.", "{Pron} sells {n}."],
        "*": [
            "Then {pron} has {n} times as many {items} as before.",
            "{Pron} buys more until {pron} has {n} times as many.",
        ],
        "/": ["{Pron} splits them equally into {n} groups and keeps one group."],
        "question": "How many {items} does {name} have now?",
    },
    {
        "intro": "A {box} holds {n} {items}.",
        "+": ["{name} puts in {n} more.", "{name} adds {n} more."],
        "-": ["{name} takes out {n}.", "{name} removes {n}."],
        "*": ["{name} fills the {box} until it holds {n} times as many."],
        "/": ["{name} divides them equally into {n} piles and leaves one pile in the {box}."],
        "question": "How many {items} are in the {box} now?",
    },
]


@dataclass(frozen=True)
class MultiStepTask:
    """What problems look like; every intermediate result stays in [1, max_value]."""

    min_steps: int = 2
    max_steps: int = 4
    max_start: int = 30  # the first number is drawn from [2, max_start]
    max_operand: int = 20  # operands of + and - from [1, max_operand]
    max_factor: int = 5  # factors and divisors of * and / from [2, max_factor]
    max_value: int = 200
    operations: tuple[str, ...] = OPERATIONS
    instruction: str | None = GSM8K_INSTRUCTION  # appended to the question; None: none
    data_source: str = DATA_SOURCE

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if unknown or "+" not in self.operations:
            # "+" is the fallback when no other operation fits the current value.
            raise ValueError(
                f"operations must include '+' and be a subset of {OPERATIONS}, got {self.operations!r}"
            )
        if not (2 <= self.max_start <= self.max_value and self.max_operand >= 1 and self.max_factor >= 2):
            raise ValueError(
                f"need 2 <= max_start <= max_value, max_operand >= 1, max_factor >= 2; got {self}"
            )
        if self.max_value < self.max_start + self.max_operand:
            raise ValueError(f"max_value={self.max_value} must be >= max_start + max_operand")


def _choose_step(rng: random.Random, value: int, task: MultiStepTask) -> tuple[str, int]:
    """An operation and operand that keep the result an integer in [1, max_value]."""
    options: dict[str, list[int]] = {
        "+": list(range(1, min(task.max_operand, task.max_value - value) + 1)),
        "-": list(range(1, min(task.max_operand, value - 1) + 1)),
        "*": [k for k in range(2, task.max_factor + 1) if value * k <= task.max_value],
        "/": [k for k in range(2, task.max_factor + 1) if value % k == 0],
    }
    ops = [op for op in task.operations if options[op]]
    op = rng.choice(ops)
    return op, rng.choice(options[op])


def _apply(value: int, op: str, operand: int) -> int:
    return {"+": value + operand, "-": value - operand, "*": value * operand, "/": value // operand}[op]


def make_problem(rng: random.Random, task: MultiStepTask) -> Problem:
    """One problem: a start value and 2–4 operations, one sentence and one worked line each."""
    name, pron = rng.choice(_NAMES)
    fill = {"name": name, "pron": pron, "Pron": pron.capitalize(), "items": rng.choice(_ITEMS)}
    fill["box"] = rng.choice(_BOXES)
    story = _STORIES[rng.randrange(len(_STORIES))]
    value = rng.randint(2, task.max_start)
    sentences = [str(story["intro"]).format(n=value, **fill)]
    lines = []
    for _ in range(rng.randint(task.min_steps, task.max_steps)):
        op, operand = _choose_step(rng, value, task)
        result = _apply(value, op, operand)
        templates = story[op]
        assert isinstance(templates, list)
        sentences.append(rng.choice(templates).format(n=operand, **fill))
        lines.append(f"{value} {op} {operand} = {result}")
        value = result
    sentences.append(str(story["question"]).format(**fill))
    return Problem(question=" ".join(sentences), solution="\n".join([*lines, f"#### {value}"]), answer=value)


def equation_chain(solution: str) -> str:
    """The worked lines without the answer line: two problems with the same chain are the same sum."""
    return solution.rsplit("\n####", 1)[0]


def make_rows(
    num_rows: int,
    seed: int,
    task: MultiStepTask,
    split: str,
    exclude_questions: set[str] | None = None,
    exclude_chains: set[str] | None = None,
) -> list[dict]:
    """`num_rows` verl-schema rows, reproducible from `seed`, with distinct questions and distinct
    equation chains, none of them in `exclude_questions` / `exclude_chains`."""
    rng = random.Random(f"multistep/{seed}/{split}")
    problems = distinct_problems(
        num_rows,
        lambda: make_problem(rng, task),
        lambda problem: (problem.question, equation_chain(problem.solution)),
        (set(exclude_questions or ()), set(exclude_chains or ())),
        f"cannot make {num_rows} distinct {split} problems with {task}: widen the number ranges or ask for fewer rows",
    )
    rows = []
    for i, problem in enumerate(problems):
        row = verl_row(problem, task.instruction, task.data_source, split, i)
        row["extra_info"]["num_steps"] = equation_chain(problem.solution).count("\n") + 1
        rows.append(row)
    return rows


def write_splits(
    out_dir: str | Path,
    num_train: int = 20000,
    num_test: int = 500,
    seed: int = 0,
    task: MultiStepTask | None = None,
    num_dev: int = 0,
) -> tuple[Path, Path]:
    """`out_dir/train.parquet` and `out_dir/test.parquet`; no test question or equation chain is in train.
    With `num_dev`, also `out_dir/dev.parquet`: problems in neither, for choosing among checkpoints
    without looking at the test set."""
    task = task or MultiStepTask()
    out_dir = Path(out_dir)
    train = make_rows(num_train, seed, task, "train")
    questions = {r["extra_info"]["question"] for r in train}
    chains = {equation_chain(r["extra_info"]["answer"]) for r in train}
    test = make_rows(num_test, seed, task, "test", exclude_questions=questions, exclude_chains=chains)
    if num_dev:
        questions |= {r["extra_info"]["question"] for r in test}
        chains |= {equation_chain(r["extra_info"]["answer"]) for r in test}
        dev = make_rows(num_dev, seed, task, "dev", exclude_questions=questions, exclude_chains=chains)
        write_parquet(dev, out_dir / "dev.parquet")
    return write_parquet(train, out_dir / "train.parquet"), write_parquet(test, out_dir / "test.parquet")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fulcrum.data.multistep", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train", type=int, default=20000, help="training rows")
    parser.add_argument("--test", type=int, default=500, help="held-out validation rows")
    parser.add_argument("--dev", type=int, default=0, help="also dev.parquet: rows in neither train nor test")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-steps", type=int, default=MultiStepTask.min_steps)
    parser.add_argument("--max-steps", type=int, default=MultiStepTask.max_steps)
    parser.add_argument("--max-start", type=int, default=MultiStepTask.max_start)
    parser.add_argument("--max-operand", type=int, default=MultiStepTask.max_operand)
    parser.add_argument("--max-factor", type=int, default=MultiStepTask.max_factor)
    parser.add_argument("--max-value", type=int, default=MultiStepTask.max_value)
    parser.add_argument("--operations", default="".join(OPERATIONS), help="any of '+-*/', with '+'")
    args = parser.parse_args(argv)
    try:
        task = MultiStepTask(
            min_steps=args.min_steps,
            max_steps=args.max_steps,
            max_start=args.max_start,
            max_operand=args.max_operand,
            max_factor=args.max_factor,
            max_value=args.max_value,
            operations=tuple(args.operations),
        )
        train, test = write_splits(args.out, args.train, args.test, args.seed, task, args.dev)
    except ValueError as err:
        parser.error(str(err))
    dev = f", {train.with_name('dev.parquet')} ({args.dev} rows)" if args.dev else ""
    print(f"wrote {train} ({args.train} rows) and {test} ({args.test} rows){dev}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
