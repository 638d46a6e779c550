"""bench/multi_turn.py's smoke path on the CPU: the summary holds every figure, the token counts add
up, only the prompts and the appended tokens are prefilled, and a slow tool holds back only its own
conversation (a structural check of the order things finished in, not a speed claim)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
from multi_turn import main


def test_the_smoke_run_reports_every_figure_and_a_slow_tool_delays_only_its_conversation(
    tmp_path: Path,
) -> None:
    out = tmp_path / "summary.json"
    # a slow tool far slower than the whole fast batch, so that a busy CPU does not blur the order
    argv = "--small --device cpu --conversations 6 --turn-tokens 6 --slow-latency-ms 500".split()
    assert main([*argv, "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    single, multi, slow = summary["single_turn"], summary["multi_turn"], summary["slow_tool"]
    assert (
        single["tok_per_s"] > 0 and multi["tok_per_s"] > 0 and multi["total_tok_per_s"] > multi["tok_per_s"]
    )
    assert summary["ratio_multi_over_single"] > 0 and isinstance(summary["meets_floor"], bool)
    # 6 conversations x 3 turns x 6 tokens, 4 tool tokens between two turns
    assert (multi["generated_tokens"], multi["appended_tokens"]) == (108, 48)
    assert multi["prefill_steps"] >= 3  # the prompts, then each turn's tool answers
    assert multi["recomputed_tokens"] == 0 and multi["evictions"] == 0 and multi["preemptions"] == 0
    assert slow["slow_finished_last"] and slow["others_done_before_slow_last_answer"]
    assert slow["slow_finish_s"] >= 2 * 0.5  # its two tool calls, waited in turn
    assert slow["others_finish_max_s"] < slow["slow_finish_s"] - 0.5
