"""The program a code reward runs inside the jail (fulcrum.sandbox), or on a SandboxFusion service: one
test of one response.

Standard library only; sent as source text (`HARNESS_SOURCE`) and started by the jail's Python runner
(or POSTed as the code of a SandboxFusion run, the job as its stdin).
It reads its job (the program, the test, a random nonce) from stdin and puts /dev/null in stdin's place
before any model code runs, keeping the job only in memory: the model's code cannot read the nonce
back, rewrite the tests, or forge a verdict. The verdict is one last line on stdout, `<nonce> <json>`; a response that exits early
(`sys.exit`, `os._exit`), hangs or crashes leaves none, and fails.

Kinds of job, as verl's `prime_code` runs them (APPS's testing_util):
- "stdin": the program runs as the body of a function `code()` (top-level imports stay outside, an
  `if __name__ == '__main__':` block is unwrapped) after APPS's star imports, with `sys.stdin` (and
  `open`, `input`) reading the test's input; its stdout is captured. `sys.exit` ends it normally;
  `exit()` and `quit()` are unavailable (verl's reliability guard). Verdict {"output": ...} or {"error": ...}.
- "call": the program is a module (after the same imports); the function `fn_name` (a method of
  `Solution()` when the code defines that class) is called with the test's JSON inputs, one per line,
  and its result compared with the JSON output as APPS compares it. Verdict {"passed": bool} or {"error"}.
- "assert": HumanEval: the program, then the problem's tests, then `check(<entry_point>)`. Verdict
  {"passed": true} when all of it ran, {"error": ...} otherwise (a SystemExit included).
"""

from __future__ import annotations

import ast
import builtins
import io
import json
import os
import sys
import traceback
from typing import Any

APPS_IMPORTS = (
    "from string import *\nfrom re import *\nfrom datetime import *\nfrom collections import *\n"
    "from heapq import *\nfrom bisect import *\nfrom copy import *\nfrom math import *\nfrom random import *\n"
    "from statistics import *\nfrom itertools import *\nfrom functools import *\nfrom operator import *\n"
    "from io import *\nfrom sys import *\nfrom json import *\nfrom builtins import *\nfrom typing import *\n"
    "import string\nimport re\nimport datetime\nimport collections\nimport heapq\nimport bisect\nimport copy\n"
    "import math\nimport random\nimport statistics\nimport itertools\nimport functools\nimport operator\n"
    "import io\nimport sys\nimport json\nsys.setrecursionlimit(6*10**5)\n"
)


def as_function(code: str) -> str:
    """APPS's rewrite of a stdin program into `def code():` (imports before the first statement stay
    at module level, later lines are indented, a final `if __name__ == '__main__':` is unwrapped)."""
    try:
        tree = ast.parse(code)
        last = tree.body[-1]
        if isinstance(last, ast.If) and ast.unparse(last.test).strip() == "__name__ == '__main__'":
            code = ast.unparse(tree.body[:-1]) + "\n" + ast.unparse(last.body)
    except Exception:
        pass
    lines = [
        (x + "\n") if x.startswith(("from ", "import ")) else ("\t" + x + "\n") for x in code.split("\n")
    ]
    out, started = "", False
    for line in lines:
        if line.startswith("\t") and not started:
            out += "stdin = sys.stdin\nstdout = sys.stdout\ndef code():\n" + line
            started = True
        elif started and line.startswith(("from ", "import ")):
            out += "\t" + line
        else:
            out += line
    return out


def run_stdin(program: str, given: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "tmp_sol"}
    try:
        exec(compile(APPS_IMPORTS + as_function(program), "<solution>", "exec", dont_inherit=True), namespace)
        method = namespace["code"]
    except BaseException as err:
        return {"error": f"compile: {type(err).__name__}: {err}"}
    lines = iter(given.split("\n"))
    fake_in = io.StringIO(given)
    fake_in.readline = lambda *a: next(lines)  # type: ignore[method-assign]
    fake_in.readlines = lambda *a: given.split("\n")  # type: ignore[method-assign]
    fake_in.read = lambda *a: given  # type: ignore[method-assign]
    captured = io.StringIO()
    real_out, real_in, real_open = sys.stdout, sys.stdin, builtins.open
    sys.stdin, sys.stdout = fake_in, captured
    builtins.open = lambda *a, **k: io.StringIO(given)  # type: ignore[assignment]
    namespace["stdin"], namespace["stdout"] = fake_in, captured
    try:
        method()
    except SystemExit:
        pass
    except BaseException as err:
        return {"error": f"runtime: {type(err).__name__}: {err}"}
    finally:
        sys.stdout, sys.stdin, builtins.open = real_out, real_in, real_open
    return {"output": captured.getvalue()}


def _int_keys(value: Any) -> Any:
    """APPS's conversion of a dict's keys to ints (a list holding one dict: that dict's)."""
    try:
        if isinstance(value, dict):
            return [{int(k): v for k, v in value.items()}]
        if isinstance(value, list) and value and isinstance(value[0], dict):
            return [{int(k): v for k, v in value[0].items()}]
    except Exception:
        pass
    return value


def run_call(program: str, fn_name: str, given: str, expected_text: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "tmp_sol"}
    try:
        exec(compile(APPS_IMPORTS + program, "<solution>", "exec", dont_inherit=True), namespace)
        owner: Any = namespace["Solution"]() if "class Solution" in program else None
        method = getattr(owner, fn_name) if owner is not None else namespace[fn_name]
    except BaseException as err:
        return {"error": f"compile: {type(err).__name__}: {err}"}
    try:
        inputs = [json.loads(line) for line in given.split("\n")]
        expected = json.loads(expected_text)
    except ValueError as err:
        return {"error": f"test case is not JSON: {err}"}
    inputs, expected = _int_keys(inputs), _int_keys(expected)
    try:
        output = method(*inputs)
        if isinstance(output, tuple):
            output = list(output)
        passed = output == expected
        if isinstance(expected, list) and expected:
            passed = passed or output == expected[0]
        try:
            if isinstance(output[0], tuple):
                passed = passed or [list(x) for x in output] == expected[0]
        except Exception:
            pass
    except BaseException as err:
        return {"error": f"runtime: {type(err).__name__}: {err}"}
    return {"passed": passed is True}


def run_assert(program: str, test: str, entry_point: str) -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "__main__"}
    try:
        exec(compile(program, "<solution>", "exec", dont_inherit=True), namespace)
        exec(compile(test, "<tests>", "exec", dont_inherit=True), namespace)
        exec(compile(f"check({entry_point})", "<check>", "exec", dont_inherit=True), namespace)
    except BaseException as err:
        return {"error": "".join(traceback.format_exception_only(type(err), err)).strip()[-500:]}
    return {"passed": True}


def main() -> None:
    job = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the job's memory file is no longer reachable from this process
    os.close(devnull)
    nonce, kind, program = job["nonce"], job["kind"], job["program"]
    out = sys.stdout
    if kind != "assert":  # verl's reliability guard
        builtins.exit = None  # type: ignore[assignment]
        builtins.quit = None  # type: ignore[assignment]
    if kind == "stdin":
        verdict = run_stdin(program, job["input"])
    elif kind == "call":
        verdict = run_call(program, job["fn_name"], job["input"], job["output"])
    else:
        verdict = run_assert(program, job["test"], job["entry_point"])
    out.write("\n" + nonce + " " + json.dumps(verdict) + "\n")
    out.flush()


if __name__ == "__main__":  # the jail's runner executes this source as __main__
    main()
