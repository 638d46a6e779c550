"""The Python tool: each call in its own jail, with a time, memory and output limit and a fresh working
folder. Whatever the model's code does comes back as text plus a counted kind; nothing raises into the
caller. (What the jail keeps out: tests/test_sandbox_jail.py.)
"""

from __future__ import annotations

import asyncio
import json
import textwrap
import time
from typing import Any

import pytest

from fulcrum.agent import FunctionCall, ToolCallResult, ToolSet
from fulcrum.agent.python_tool import PythonTool
from fulcrum.sandbox import JailLimits, JailResult, run_jailed


def python_tool(**config: Any) -> PythonTool:
    return PythonTool({"default_timeout": 10, "memory_limit_mb": 512, **config}, None)


def run_code(code: str, **config: Any) -> ToolCallResult:
    """One call of the Python tool as the agent loop makes it; the response is not cut."""
    toolset = ToolSet([python_tool(**config)], max_tool_response_length=1_000_000)
    call = FunctionCall("code_interpreter", json.dumps({"code": textwrap.dedent(code)}))
    (result,) = asyncio.run(toolset.run_turn([call]))
    return result


def errors(result: ToolCallResult) -> set[str]:
    prefix = "tools/errors/"
    return {k[len(prefix) :] for k, v in result.metrics.items() if k.startswith(prefix) and v}


def test_a_correct_computation_prints_its_answer() -> None:
    result = run_code("import math\nprint(sum(math.comb(10, k) for k in range(11)))")
    assert result.response.text == "1024\n"
    assert result.metrics == {"tools/calls": 1.0, "tools/errors": 0.0}


def test_an_exception_becomes_its_traceback_for_the_model() -> None:
    result = run_code("def f(x):\n    return 1 / x\nprint('before')\nf(0)")
    text = result.response.text
    assert text.startswith("before\nTraceback (most recent call last):")
    assert 'File "<code>", line 2, in f' in text and "return 1 / x" in text
    assert text.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "runner" not in text  # the runner's own frames are not shown
    assert errors(result) == {"exception"}


def test_the_code_runs_as_python_runs_it_annotations_evaluated() -> None:
    """An annotation naming nothing fails at the definition, as `python` runs it (not postponed, as it
    would be under the runner's own `from __future__ import annotations`)."""
    result = run_code("def f() -> Optional[int]:\n    return 1\nprint(f())")
    assert "NameError: name 'Optional' is not defined" in result.response.text


def test_a_hang_is_killed_at_the_time_limit() -> None:
    started = time.monotonic()
    result = run_code("import time\nprint('started')\ntime.sleep(60)", default_timeout=1)
    assert time.monotonic() - started < 5
    assert errors(result) == {"timeout"}
    # unbuffered: what it printed before the kill is kept
    assert result.response.text == "started\n[timed out: the process was killed after 1 s]"


def test_a_cpu_loop_stops_at_the_cpu_limit_before_the_wall_clock_one() -> None:
    limits = JailLimits(timeout_s=20.0, cpu_s=1)
    started = time.monotonic()
    result: JailResult = asyncio.run(run_jailed("while True:\n    pass", limits=limits))
    assert time.monotonic() - started < 10
    assert result.timed_out and result.exit_code is None


def test_a_memory_bomb_hits_the_memory_limit() -> None:
    result = run_code(
        "blocks = []\nwhile True:\n    blocks.append(bytearray(50 * 2**20))", memory_limit_mb=300
    )
    assert errors(result) == {"memory"}
    assert "[memory limit of 300 MB reached]" in result.response.text


def test_megabytes_of_output_are_cut_and_do_not_block() -> None:
    started = time.monotonic()
    result = run_code(
        "import sys\nfor i in range(10**6):\n    print('x' * 100)\n    print('e' * 100, file=sys.stderr)",
        max_output_bytes=2000,
        max_file_mb=1,
    )
    assert time.monotonic() - started < 15
    text = result.response.text
    assert len(text) < 2 * 2000 + 500  # at most the limit of each stream, plus the notes
    assert text.startswith("x" * 100 + "\n")
    assert "output truncated to the first 2000 bytes of each stream" in text
    assert "output_truncated" in errors(result)


def test_its_own_directory_is_writable_fresh_and_removed_afterwards() -> None:
    result = run_code(
        """
        import os, tempfile
        print(sorted(os.listdir('.')))
        with open('notes.txt', 'w') as f:
            f.write('kept for this call')
        with tempfile.NamedTemporaryFile(dir=None) as t:
            pass
        print(open('notes.txt').read())
        print(os.getcwd())
        """
    )
    _, content, cwd = result.response.text.splitlines()
    assert content == "kept for this call" and errors(result) == set() and cwd == "/tmp"
    again = run_code("import os\nprint(os.path.exists('notes.txt'))")
    assert again.response.text == "False\n"  # the next call starts with a fresh folder


def test_subprocesses_threads_and_numpy_work_inside() -> None:
    result = run_code(
        """
        import subprocess, threading, numpy as np
        print(subprocess.run(['sh', '-c', 'echo $((6*7))'], capture_output=True, text=True).stdout.strip())
        t = threading.Thread(target=print, args=('thread',))
        t.start(); t.join()
        print(int(np.arange(10).sum()))
        """
    )
    assert result.response.text == "42\nthread\n45\n" and errors(result) == set()


def test_the_trainers_environment_is_not_passed_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret_value")
    result = run_code("import os\nprint(sorted(os.environ))\nprint(os.environ.get('HF_TOKEN'))")
    assert "hf_secret_value" not in result.response.text and result.response.text.endswith("None\n")


def test_two_slow_calls_overlap_and_num_workers_bounds_them() -> None:
    code = json.dumps({"code": "import time\ntime.sleep(1)\nprint('done')"})

    def wall(num_workers: int) -> tuple[float, list[ToolCallResult]]:
        toolset = ToolSet([python_tool(num_workers=num_workers)], max_parallel_calls=2)
        started = time.monotonic()
        results = asyncio.run(toolset.run_turn([FunctionCall("code_interpreter", code)] * 2))
        return time.monotonic() - started, results

    together, results = wall(num_workers=2)
    assert [r.response.text for r in results] == ["done\n", "done\n"]
    assert together < 1.9
    one_at_a_time, _ = wall(num_workers=1)
    assert one_at_a_time >= 2.0


def test_the_model_may_shorten_the_time_limit_but_not_lengthen_it() -> None:
    tool = python_tool(default_timeout=2)
    assert tool.call_limits({"timeout": 0.5}).timeout_s == 0.5
    assert tool.call_limits({"timeout": 3600}).timeout_s == 2
    result = run_code("print('hi')", default_language="python")
    assert result.response.text == "hi\n"
    other = asyncio.run(tool.execute("i", {"code": "1", "language": "bash"}))
    assert other[0].text == "Error when executing tool: only Python runs here, not 'bash'"
