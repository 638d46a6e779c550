"""A built-in task: GSM8K-format arithmetic word problems, generated from a seed.

Rows follow verl's parquet schema (docs/design.md, "Data"), so every part of the project that reads GSM8K reads
these too: `data_source`, `prompt` (chat messages), `ability`, `reward_model {style, ground_truth}`,
`extra_info {split, index, question, answer}`. The gold answer (`extra_info.answer`) is a worked
solution in GSM8K's style, one line per operation and the result after `####`:

    Mia has 7 pears. She buys 5 more. How many pears does Mia have now?   ->   7 + 5 = 12
                                                                              #### 12

so the GSM8K scorer grades responses to it. Difficulty knobs (`ArithmeticTask`): operand range, which
operations, how many operations per problem. The task exists so that the demo (and tests) can show a
tiny model learning something real in minutes on a CPU; it is not a benchmark.

`python -m fulcrum.data.synthetic --out DIR [--train N --test N --seed S ...]` writes
`DIR/train.parquet` and `DIR/test.parquet`.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "synthetic/arithmetic"

_NAMES = [
    ("Mia", "She"),
    ("Tom", "He"),
    ("Ava", "She"),
    ("Sam", "He"),
    ("Lily", "She"),
    ("Ben", "He"),
    ("Zoe", "She"),
    ("Max", "He"),
]
_ITEMS = [("apple", "apples"), ("pear", "pears"), ("book", "books"), ("coin", "coins"), ("card", "cards")]
_BOXES = ["box", "bag", "jar"]

CONTEXT_KINDS = ("owner", "container")
# Each context (one per CONTEXT_KINDS entry): an opening sentence holding the first number, step sentences per operation, a question.
# Placeholders: {name} {pron} {n} {items} {box}.
_CONTEXTS: list[dict[str, object]] = [
    {
        "intro": "{name} has {n} {items}.",
        "+": ["{pron} buys {n} more.", "{pron} finds {n} more.", "{pron} gets {n} more."],
        "-": ["{pron} gives away {n}.", "{pron} loses {n}.", "{pron} sells {n}."],
        "question": "How many {items_pl} does {name} have now?",
    },
    {
        "intro": "A {box} holds {n} {items}.",
        "+": ["{name} puts in {n} more.", "{name} adds {n} more."],
        "-": ["{name} takes out {n}.", "{name} removes {n}."],
        "question": "How many {items_pl} are in the {box} now?",
    },
]


@dataclass(frozen=True)
class ArithmeticTask:
    """What problems look like. Results never go below zero (a subtraction takes at most what is there)."""

    min_operand: int = 1
    max_operand: int = 20
    operations: tuple[str, ...] = ("+", "-")  # any of "+", "-"
    num_operations: int = 1  # operations per problem: 1 gives "a + b", 2 gives "a + b - c", ...
    # Appended to the question, as in verl's gsm8k prompt; None: no instruction.
    instruction: str | None = GSM8K_INSTRUCTION
    # Gold solutions show one equation line per operation before "#### <answer>"; False: the answer only.
    # The scorer checks only the answer, so under RL a worked line that is wrong but ends in the right
    # number is rewarded as much as a right one: answer-only keeps every rewarded sample a right one.
    show_work: bool = True
    # Fraction of gold solutions that end in GSM8K's "#### <answer>"; the others end in "The answer is
    # <answer>." (demonstrations of mixed style, as pooled SFT data often is). One number for all
    # problems, or one per story kind (CONTEXT_KINDS order: "owner" stories, "container" stories).
    # Only "####" scores under the strict GSM8K scorer, so a reward-trained policy must settle on it.
    marked_fraction: float | tuple[float, ...] = 1.0
    data_source: str = DATA_SOURCE

    def __post_init__(self) -> None:
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 0 <= min_operand <= max_operand, got min_operand={self.min_operand}, "
                f"max_operand={self.max_operand}"
            )
        unknown = [op for op in self.operations if op not in ("+", "-")]
        if unknown or not self.operations:
            raise ValueError(f"operations must be a non-empty subset of ('+', '-'), got {self.operations!r}")
        fractions = self.marked_fractions()
        if len(fractions) != len(CONTEXT_KINDS) or not all(0.0 <= f <= 1.0 for f in fractions):
            raise ValueError(
                f"marked_fraction must be a number in [0, 1] or one per story kind {CONTEXT_KINDS}, "
                f"got {self.marked_fraction!r}"
            )
        if self.num_operations < 1:
            raise ValueError(f"num_operations must be >= 1, got {self.num_operations}")

    def marked_fractions(self) -> tuple[float, ...]:
        """`marked_fraction` per story kind."""
        if isinstance(self.marked_fraction, (int, float)):
            return (float(self.marked_fraction),) * len(CONTEXT_KINDS)
        return tuple(float(f) for f in self.marked_fraction)


@dataclass(frozen=True)
class Problem:
    question: str  # the word problem, without the instruction
    solution: str  # worked solution in GSM8K's format, ending in "#### <answer>"
    answer: int


def _count(n: int, item: tuple[str, str]) -> str:
    return f"{n} {item[0] if n == 1 else item[1]}"


def make_problem(rng: random.Random, task: ArithmeticTask) -> Problem:
    """One problem: a start value and `task.num_operations` steps, each a sentence and a solution line."""
    name, pron = rng.choice(_NAMES)
    item = rng.choice(_ITEMS)
    box = rng.choice(_BOXES)
    kind = rng.randrange(len(_CONTEXTS))
    context = _CONTEXTS[kind]
    fill = {"name": name, "pron": pron, "box": box, "items_pl": item[1]}

    value = rng.randint(task.min_operand, task.max_operand)
    intro = str(context["intro"]).replace("{n} {items}", _count(value, item))
    sentences = [intro.format(**fill)]
    lines = []
    for _ in range(task.num_operations):
        # Subtracting from a value below min_operand would force a negative result: add instead.
        ops = [op for op in task.operations if op == "+" or value >= task.min_operand]
        op = rng.choice(ops or ["+"])
        operand = rng.randint(
            task.min_operand, task.max_operand if op == "+" else min(value, task.max_operand)
        )
        result = value + operand if op == "+" else value - operand
        templates = context[op]
        assert isinstance(templates, list)
        sentences.append(rng.choice(templates).format(n=operand, **fill))
        lines.append(f"{value} {op} {operand} = {result}")
        value = result
    sentences.append(str(context["question"]).format(**fill))
    # Drawn only when styles mix, so that the default task's problems do not depend on this knob.
    fraction = task.marked_fractions()[kind]
    marked = fraction >= 1.0 or rng.random() < fraction
    ending = f"#### {value}" if marked else f"The answer is {value}."
    solution = "\n".join([*lines, ending] if task.show_work else [ending])
    return Problem(question=" ".join(sentences), solution=solution, answer=value)


def make_rows(
    num_rows: int, seed: int, task: ArithmeticTask, split: str, exclude: set[str] | None = None
) -> list[dict]:
    """`num_rows` verl-schema rows with distinct questions (none in `exclude`), reproducible from `seed`."""
    rng = random.Random(f"{seed}/{split}")
    problems = distinct_problems(
        num_rows,
        lambda: make_problem(rng, task),
        lambda problem: (problem.question,),
        (set(exclude or ()),),
        f"cannot make {num_rows} distinct {split} problems with {task}: widen the operand range or ask for fewer rows",
    )
    return [
        verl_row(problem, task.instruction, task.data_source, split, i) for i, problem in enumerate(problems)
    ]


def distinct_problems(
    count: int,
    draw: Callable[[], Problem],
    keys: Callable[[Problem], tuple[str, ...]],
    seen: tuple[set[str], ...],
    refusal: str,
) -> list[Problem]:
    """`count` drawn problems whose keys are each new to their set of `seen` (a key per set, added as the
    problem is taken); after 50·count + 1000 draws the task's space is too small: ValueError(`refusal`)."""
    problems: list[Problem] = []
    attempts = 0
    while len(problems) < count:
        attempts += 1
        if attempts > 50 * count + 1000:
            raise ValueError(f"{refusal} (made {len(problems)})")
        problem = draw()
        problem_keys = keys(problem)
        if any(key in taken for key, taken in zip(problem_keys, seen, strict=True)):
            continue
        for key, taken in zip(problem_keys, seen, strict=True):
            taken.add(key)
        problems.append(problem)
    return problems


def verl_row(problem: Problem, instruction: str | None, data_source: str, split: str, index: int) -> dict:
    """One problem as a verl parquet row: the question (plus `instruction`) as one user message."""
    content = problem.question if instruction is None else f"{problem.question} {instruction}"
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {
            "split": split,
            "index": index,
            "question": problem.question,
            "answer": problem.solution,
        },
    }


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_splits(
    out_dir: str | Path,
    num_train: int = 2000,
    num_test: int = 200,
    seed: int = 0,
    task: ArithmeticTask | None = None,
) -> tuple[Path, Path]:
    """`out_dir/train.parquet` and `out_dir/test.parquet`; no test question appears in train."""
    task = task or ArithmeticTask()
    out_dir = Path(out_dir)
    train = make_rows(num_train, seed, task, "train")
    test = make_rows(num_test, seed, task, "test", exclude={r["extra_info"]["question"] for r in train})
    return write_parquet(train, out_dir / "train.parquet"), write_parquet(test, out_dir / "test.parquet")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fulcrum.data.synthetic", description="Write GSM8K-format arithmetic word problems."
    )
    parser.add_argument("--out", required=True, help="folder for train.parquet and test.parquet")
    parser.add_argument("--train", type=int, default=2000, help="training rows")
    parser.add_argument("--test", type=int, default=200, help="test rows")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-operand", type=int, default=1)
    parser.add_argument("--max-operand", type=int, default=20)
    parser.add_argument("--operations", default="+-", help="any of '+', '-', e.g. '+-'")
    parser.add_argument("--num-operations", type=int, default=1, help="operations per problem")
    parser.add_argument("--no-instruction", action="store_true", help="omit the GSM8K instruction")
    parser.add_argument(
        "--answer-only", action="store_true", help="gold solutions without the equation lines"
    )
    args = parser.parse_args(argv)
    try:
        task = ArithmeticTask(
            min_operand=args.min_operand,
            max_operand=args.max_operand,
            operations=tuple(args.operations),
            num_operations=args.num_operations,
            instruction=None if args.no_instruction else GSM8K_INSTRUCTION,
            show_work=not args.answer_only,
        )
        train, test = write_splits(args.out, args.train, args.test, args.seed, task)
    except ValueError as err:
        parser.error(str(err))
    print(f"wrote {train} ({args.train} rows) and {test} ({args.test} rows)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
