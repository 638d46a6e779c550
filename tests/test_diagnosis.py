"""The diagnosis rules over metrics rows: each fires on the pattern it names and stays silent on a
healthy run; the live wrapper says each one once."""

from __future__ import annotations

from typing import Any

from fulcrum.trainer.diagnosis import LiveDiagnosis, diagnose
from fulcrum.trainer.diagnosis_resources import phase_shares


def healthy_rows(n: int = 12) -> list[dict[str, Any]]:
    """A run that learns: flat KL, a critic whose explained variance rises, short answers, flat memory."""
    rows = []
    for step in range(1, n + 1):
        rows.append(
            {
                "step": step,
                "timing_s/step": 10.0,
                "timing_s/gen": 2.0,
                "timing_s/update_actor": 5.0,
                "timing_s/update_critic": 3.0,
                "actor/ppo_kl": 0.002 + 0.0001 * (step % 3),
                "actor/pg_loss": 0.01,
                "actor/grad_norm": 1.0,
                "critic/vf_loss": 1.0 / step,
                "critic/vf_explained_var": min(0.9, 0.1 * step),
                "critic/advantages/mean": 0.01 * (-1) ** step,
                "response_length/clip_ratio": 0.02,
                "perf/max_memory_reserved_gb": 40.0 if step > 1 else 30.0,
                "training/nan_skipped_steps": 0.0,
            }
        )
    return rows


def rules(rows: list[dict[str, Any]]) -> set[str]:
    return {f.rule for f in diagnose(rows)}


def test_healthy_run_only_names_its_bottleneck() -> None:
    findings = diagnose(healthy_rows())
    assert [f.rule for f in findings] == ["bottleneck"]
    assert "update_actor: 50% of step time" in findings[0].message
    assert "ppo_micro_batch_size_per_gpu" in findings[0].fix


def test_bottleneck_leaves_out_the_warm_up_step() -> None:
    rows = healthy_rows(3)
    rows[0]["timing_s/gen"] = 100.0  # compiling on step 1
    rows[0]["timing_s/step"] = 108.0
    assert next(iter(phase_shares(rows))) == "update_actor"
    assert phase_shares(rows)["gen"] == 0.2


def test_kl_spike_far_above_its_running_median() -> None:
    rows = healthy_rows()
    rows[8]["actor/ppo_kl"] = 0.05  # 25x the median of ~0.002
    findings = [f for f in diagnose(rows) if f.rule == "kl_spike"]
    assert len(findings) == 1 and findings[0].step == 9
    assert "actor/ppo_kl" in findings[0].message and "optim.lr" in findings[0].fix
    rows[8]["actor/ppo_kl"] = 0.006  # 3x: noise, not a spike
    assert "kl_spike" not in rules(rows)
    for row in rows:  # a policy that barely moves: 0.0002 -> 0.003 is 15x, and still nothing
        row["actor/ppo_kl"] = 0.0002
    rows[8]["actor/ppo_kl"] = 0.003
    assert "kl_spike" not in rules(rows)


def test_kl_high_from_the_first_steps_which_the_spike_rule_cannot_see() -> None:
    """bench/learning.py at actor lr 3e-4 (2026-12-01): actor/ppo_kl 0.17, 0.04, 0.04, ... from step 1,
    so its running median was high too and kl_spike stayed silent while the run lost the task."""
    rows = healthy_rows()
    for row, kl in zip(
        rows, [0.17, 0.04, 0.037, 0.043, 0.0056, 0.04, 0.06, 0.017, 0.066, 0.05, 0.04, 0.03], strict=True
    ):
        row["actor/ppo_kl"] = kl
    assert "kl_spike" not in rules(rows)
    findings = [f for f in diagnose(rows) if f.rule == "kl_high"]
    assert [f.step for f in findings] == [3]
    assert "actor/ppo_kl = 0.04" in findings[0].message and "actor.optim.lr" in findings[0].fix
    rows = healthy_rows()
    rows[3]["actor/ppo_kl"] = rows[7]["actor/ppo_kl"] = 0.03  # single steps: the spike rule's part
    assert "kl_high" not in rules(rows)
    for row in rows:
        row["actor/kl_loss"] = 0.09  # the KL to the reference of a healthy run
    assert "kl_high" not in rules(rows)
    for row in rows[4:]:
        row["actor/kl_loss"] = 2.5
    assert [f.step for f in diagnose(rows) if f.rule == "kl_high"] == [6]  # steps 4-6: 0.09, 2.5, 2.5


def test_reward_collapse_against_its_best_stretch() -> None:
    rows = healthy_rows(20)
    scores = [
        0.3,
        0.4,
        0.5,
        0.6,
        0.7,
        0.7,
        0.75,
        0.7,
        0.8,
        0.75,
        0.7,
        0.72,
        0.2,
        0.1,
        0.15,
        0.1,
        0.2,
        0.1,
        0.1,
        0.1,
    ]
    for row, score in zip(rows, scores, strict=True):
        row["critic/score/mean"] = score
    findings = [f for f in diagnose(rows) if f.rule == "reward_collapse"]
    assert [f.step for f in findings] == [15]  # steps 11-15's median 0.2 < half of steps 6-10's 0.75
    assert "0.2 (median" in findings[0].message and "resume_from_path" in findings[0].fix
    for row, score in zip(rows, scores, strict=True):
        row["critic/score/mean"] = min(score, 0.5) if score > 0.3 else 0.4  # noisy, never halved
    assert "reward_collapse" not in rules(rows)
    for row in rows:
        row["critic/score/mean"] = -0.5 - 0.01 * row["step"]  # a negative reward has no "half"
    assert "reward_collapse" not in rules(rows)
    # a base model under GSM8K's strict reward: one lucky answer in 512 now and then is not a skill lost
    lucky = [0.002, 0.0, 0.0059, 0.0, 0.002, 0.0, 0.0039, 0.0, 0.0, 0.0] + [0.0] * 10
    for row, score in zip(rows, lucky, strict=True):
        row["critic/score/mean"] = score
    assert "reward_collapse" not in rules(rows)


def test_validation_drop_below_half_its_best() -> None:
    rows = healthy_rows()
    key = "val-core/gsm8k/reward/mean@1"
    rows.insert(0, {"step": 0, key: 0.41})  # validation before training, as the trainer logs it
    for row, score in zip(rows[5::5], [0.58, 0.57], strict=True):
        row[key] = score
    assert "validation_drop" not in rules(rows)
    rows[10][key] = 0.026
    findings = [f for f in diagnose(rows) if f.rule == "validation_drop"]
    assert [f.step for f in findings] == [10]
    assert "0.026, below half of its best 0.58" in findings[0].message


def test_critic_that_does_not_learn() -> None:
    rows = healthy_rows()
    for row in rows:
        row["critic/vf_explained_var"] = -0.05
        row["critic/vf_loss"] = 0.5
    findings = [f for f in diagnose(rows) if f.rule == "critic_not_learning"]
    assert findings and "critic.optim.lr" in findings[0].fix
    assert "critic_not_learning" not in rules(rows[:9])  # too early to tell


def test_advantages_drifting_from_zero() -> None:
    rows = healthy_rows()
    for row in rows[4:7]:
        row["critic/advantages/mean"] = 0.4
    assert [f.step for f in diagnose(rows) if f.rule == "advantage_drift"] == [7]
    rows[5]["critic/advantages/mean"] = 0.0  # not 3 steps in a row
    assert "advantage_drift" not in rules(rows)


def test_responses_at_the_length_limit() -> None:
    rows = healthy_rows()
    for row in rows[-3:]:
        row["response_length/clip_ratio"] = 0.5
    findings = [f for f in diagnose(rows) if f.rule == "length_limit"]
    assert findings and "50% of responses" in findings[0].message
    assert "data.max_response_length" in findings[0].fix
    rows[-1]["response_length/clip_ratio"] = rows[-2]["response_length/clip_ratio"] = 0.0
    assert "length_limit" not in rules(rows)  # the last 3 steps average 17%


def test_a_reward_out_of_reach_is_named_with_its_lever() -> None:
    """A reward no sample reaches in 16 of 20 steps (strict GSM8K on a model that never writes '####'):
    named at the 20th step; rare rewards every other step (a run that can still find the format) are not."""
    rows = healthy_rows(24)
    for row in rows:
        row["critic/score/max"] = 1.0 if row["step"] % 5 == 0 else 0.0
        row["critic/score/min"] = 0.0
        row["actor/entropy"] = 0.4 - 0.005 * row["step"]
    findings = [f for f in diagnose(rows[:20]) if f.rule == "reward_out_of_reach"]
    assert len(findings) == 1 and findings[0].step == 20
    assert "16 of the last 20 steps" in findings[0].message and "entropy 0.40 -> 0.30" in findings[0].message
    assert "'#### N'" in findings[0].fix and "rollout.n" in findings[0].fix
    assert "reward_out_of_reach" not in rules(rows[:19])  # too early to tell
    for row in rows:
        row["critic/score/max"] = 1.0 if row["step"] % 2 == 0 else 0.0
    assert "reward_out_of_reach" not in rules(rows)
    assert "reward_out_of_reach" not in rules(healthy_rows(24))  # rows without the scores' range
    for row in rows:  # every sample solved: too easy, not out of reach
        row["critic/score/max"] = row["critic/score/min"] = 1.0
    assert "reward_out_of_reach" not in rules(rows)


def test_grpo_groups_that_all_score_alike() -> None:
    rows = healthy_rows()
    for i, row in enumerate(rows):
        row["critic/score/groups_alike"] = 0.2 if i < 6 else 0.8
        row["critic/score/mean"] = 0.9
    findings = [f for f in diagnose(rows) if f.rule == "groups_without_signal"]
    assert len(findings) == 1 and findings[0].step == 12
    assert "0.80" in findings[0].message and "mostly solved" in findings[0].message
    assert "rollout.n" in findings[0].fix and "filter_groups" in findings[0].fix
    rows[-1]["critic/score/groups_alike"] = rows[-2]["critic/score/groups_alike"] = 0.1
    rows[-3]["critic/score/groups_alike"] = 0.3
    assert "groups_without_signal" not in rules(rows)  # the median of the last 5 is 0.3
    assert "groups_without_signal" not in rules(healthy_rows())  # PPO rows carry no such metric


def test_dapo_filter_dropping_most_groups() -> None:
    rows = healthy_rows()
    for i, row in enumerate(rows):
        row["critic/score/groups_alike"] = 0.0  # the kept batch: signal by construction
        row["training/filter_groups/groups_alike"] = 0.5 if i < 6 else 0.8
        row["train/num_gen_batches"] = 2.0 if i < 6 else 5.0
    findings = [f for f in diagnose(rows) if f.rule == "groups_without_signal"]
    assert len(findings) == 1 and findings[0].step == 12
    assert "0.80" in findings[0].message and "costs 5.0 generated ones" in findings[0].message
    assert "5 generation rounds" in findings[0].message
    assert "rollout.n" in findings[0].fix and "filter_groups.enable" not in findings[0].fix  # it is on
    for row in rows[-3:]:
        row["training/filter_groups/groups_alike"] = 0.6  # 2.5 generated a kept group: the filter's price
    assert "groups_without_signal" not in rules(rows)


def test_memory_creeping_up_after_warm_up() -> None:
    rows = healthy_rows()
    for i, row in enumerate(rows):
        row["perf/max_memory_reserved_gb"] = 40.0 + 0.5 * i
    findings = [f for f in diagnose(rows) if f.rule == "memory_creep"]
    assert findings and "expandable_segments" in findings[0].fix
    for i, row in enumerate(rows):  # growth only in the first steps: allocation, not a leak
        row["perf/max_memory_reserved_gb"] = 40.0 + min(i, 2) * 5.0
    assert "memory_creep" not in rules(rows)
    for i, row in enumerate(rows):  # the training graphs' pool growing while graphs are captured
        row["perf/max_memory_reserved_gb"] = 40.0 + 0.5 * i
        row["perf/graph_captures"] = 3.0
    assert "memory_creep" not in rules(rows)
    for row in rows[:-2]:
        row["perf/graph_captures"] = 0.0  # growing in steps that captured nothing: a leak after all
    assert "memory_creep" in rules(rows)


def test_nan_and_skipped_steps() -> None:
    rows = healthy_rows()
    rows[5]["actor/grad_norm"] = "nan"  # as metrics.jsonl writes it
    for row in rows[5:]:
        row["training/nan_skipped_steps"] = 1.0
    findings = [f for f in diagnose(rows) if f.rule == "non_finite"]
    assert findings[0].step == 6
    assert "actor/grad_norm" in findings[0].message and "1 step(s) skipped" in findings[0].message
    rows[5]["actor/grad_norm"] = 1.0
    for row in rows:
        row["training/nan_skipped_steps"] = 0.0
    assert "non_finite" not in rules(rows)


def test_live_diagnosis_says_each_rule_once() -> None:
    live = LiveDiagnosis()
    printed = []
    for row in healthy_rows():
        row = dict(row)
        row["response_length/clip_ratio"] = 0.9
        step = row.pop("step")
        printed += live.observe(row, step)
    assert len(printed) == 2
    assert printed[0].startswith("diagnosis (length_limit) step 1:")
    assert printed[1].startswith("diagnosis (bottleneck)")  # once the warm steps tell


def test_a_saturated_host_while_the_host_driven_phases_bound_the_step() -> None:
    rows = healthy_rows()  # update_actor + update_critic: 80 % of each step
    for row in rows:
        row["perf/cpu_load"] = 1.4
    findings = [f for f in diagnose(rows) if f.rule == "host_loaded"]
    assert findings and findings[0].severity == "warning"
    assert "1.40 runnable tasks per CPU" in findings[0].message and "80%" in findings[0].message
    assert "micro-batch" in findings[0].fix and "free the host's CPUs" in findings[0].fix
    for row in rows[-3:]:
        row["perf/cpu_load"] = 0.2  # the load went: the median of the last 3 steps decides
    assert "host_loaded" not in rules(rows)
    for row in rows:  # loaded, but generation (CUDA graphs) is most of the step
        row["perf/cpu_load"] = 1.4
        row["timing_s/gen"], row["timing_s/update_actor"], row["timing_s/update_critic"] = 8.0, 1.0, 0.5
    assert "host_loaded" not in rules(rows)


def test_a_saturated_host_is_not_flagged_when_the_training_micro_batches_replay_as_graphs() -> None:
    rows = healthy_rows()  # update_actor + update_critic: 80 % of each step
    for row in rows:
        row["perf/cpu_load"] = 1.4
    assert "host_loaded" in rules(rows)
    for row in rows:
        row["perf/graph_captures"] = 0.0  # the run's micro-batches replay captured graphs
    assert "host_loaded" not in rules(rows)


def long_tailed_rows(share: float, partial: bool = False) -> list[dict[str, Any]]:
    """Steps whose generation is 70 % of the step, responses up to 4x their mean, the decode at `share` of
    its memory floor; `partial`: under partial rollouts."""
    rows = healthy_rows()
    for row in rows:
        row["timing_s/gen"], row["timing_s/update_actor"], row["timing_s/update_critic"] = 7.0, 2.0, 1.0
        row["response_length/mean"], row["response_length/max"] = 2000.0, 8000.0
        row["rollout/decode_roofline_share"] = share
        if partial:
            row["training/off_policy/carried_token_share"] = 0.45
    return rows


def test_a_long_tail_at_a_small_batch_points_to_partial_rollouts() -> None:
    findings = [f for f in diagnose(long_tailed_rows(0.2)) if f.rule == "long_tail"]
    assert findings and findings[0].severity == "info"
    assert "20% of its memory floor" in findings[0].message and "4.0x the mean" in findings[0].message
    assert "up to 71% of the generation" in findings[0].message  # 1 - 0.2 / 0.7
    assert "trainer.v1.trainer_mode=colocate_async" in findings[0].fix
    assert "free_cache_engine=False" in findings[0].fix and "bypass_mode=True" in findings[0].fix
    # the synchronous steps measured at Qwen2.5-0.5B's shape: the decode at 0.46 of its floor, and partial
    # rollouts keeping their K/V ran 1.27x their trained tokens a second
    assert "long_tail" in rules(long_tailed_rows(0.46))
    # Qwen3-0.6B's shape: the decode at ~0.7 of its floor, no tail to take back
    assert "long_tail" not in rules(long_tailed_rows(0.69))
    rows = long_tailed_rows(0.2)
    for row in rows:
        row["response_length/max"] = 2500.0  # lengths alike: no tail
    assert "long_tail" not in rules(rows)
    rows = long_tailed_rows(0.2)
    for row in rows:
        row["timing_s/gen"], row["timing_s/update_actor"] = 2.0, 7.0  # training bounds the step
    assert "long_tail" not in rules(rows)
    assert "long_tail" not in rules(healthy_rows())  # no roofline logged (an unknown card, the CPU)


def test_the_long_tail_rule_is_silent_under_partial_rollouts() -> None:
    """Their decode's share is what they made of the tail: 0.52-0.61 in the run that was 1.27x its
    synchronous steps; it cannot say whether synchronous steps would be slower."""
    for share in (0.3, 0.6, 0.75):
        assert "long_tail" not in rules(long_tailed_rows(share, partial=True))


def partial_rows(prefill_s: float, old_log_prob_s: float) -> list[dict[str, Any]]:
    """Steps of 30 s under partial rollouts with the engine's prefill and the old-log-prob pass as given."""
    rows = long_tailed_rows(0.57, partial=True)
    for row in rows:
        row["timing_s/step"] = 30.0
        row["rollout/prefill_s"], row["rollout/prefill_tokens"] = prefill_s, 1_068_729.0
        row["timing_s/old_log_prob"] = old_log_prob_s
    return rows


def test_partial_rollouts_are_told_what_their_own_costs_take_and_which_keys_remove_them() -> None:
    """As measured at Qwen2.5-0.5B's shape (BENCHMARKS.md): the held samples prefilled again, 2.2 s a step,
    and the old-log-prob pass, 3.0 s, of 30 s: each part gets its key."""
    findings = [f for f in diagnose(partial_rows(2.2, 3.0)) if f.rule == "partial_rollout_costs"]
    assert findings and findings[0].severity == "info"
    assert "17% of the step (30.0 s)" in findings[0].message  # (2.2 + 3.0) / 30
    assert (
        "prefill 2.2 s (1,068,729 tokens)" in findings[0].message
        and "old-log-prob pass 3.0 s" in findings[0].message
    )
    assert "free_cache_engine=False" in findings[0].fix and "bypass_mode=True" in findings[0].fix
    only_prefill = [f for f in diagnose(partial_rows(3.5, 0.0)) if f.rule == "partial_rollout_costs"]
    assert only_prefill and "bypass_mode" not in only_prefill[0].fix  # bypass mode already: no pass
    assert "partial_rollout_costs" not in rules(partial_rows(0.3, 0.0))  # the cache kept, bypass on
    rows = partial_rows(2.2, 3.0)
    for row in rows:
        del row["training/off_policy/carried_token_share"]  # synchronous steps: not this rule's
    assert "partial_rollout_costs" not in rules(rows)


def prefill_rows(prefill_s: float, partial: bool = False) -> list[dict[str, Any]]:
    """Synchronous steps of 10 s whose engine prefill took `prefill_s` for 2 M tokens (prompts of ~4k)."""
    rows = long_tailed_rows(0.6, partial=partial)
    for row in rows:
        row["timing_s/step"] = 10.0
        row["rollout/prefill_s"], row["rollout/prefill_tokens"] = prefill_s, 2_000_000.0
    return rows


def test_a_prefill_that_takes_a_share_of_the_step_names_the_faster_prefill_kernels() -> None:
    findings = [f for f in diagnose(prefill_rows(2.0)) if f.rule == "long_prefill"]
    assert findings and findings[0].severity == "info"
    assert "20% of the step (2.0 s of 10.0 s for 2,000,000 tokens, 1,000,000 a second)" in findings[0].message
    assert "prefill_attention=fa4" in findings[0].fix and "=cudnn" in findings[0].fix
    assert "long_prefill" not in rules(
        prefill_rows(1.0)
    )  # 10 % of the step: what a kernel takes back is small
    # under partial rollouts the held samples' prefill is partial_rollout_costs' (keep their K/V first)
    assert "long_prefill" not in rules(prefill_rows(2.0, partial=True))
    assert "long_prefill" not in rules(healthy_rows())  # no engine counters (the HF engine)


def recompute_rows(prefilled: float, preemptions: float, partial: bool = True) -> list[dict[str, Any]]:
    """Steps whose engine sampled 1 M tokens and prefilled `prefilled` with `preemptions` preemptions."""
    rows = long_tailed_rows(0.53, partial=partial)
    for row in rows:
        row["rollout/generated_tokens"], row["rollout/prefill_tokens"] = 1_000_000.0, prefilled
        row["rollout/preemptions"] = preemptions
    return rows


def test_an_engine_recomputing_what_it_preempts_names_the_sequences_in_flight() -> None:
    # Partial rollouts at Qwen3-0.6B's shape on an H100: 2,523 preemptions, 1.02 M tokens prefilled a step.
    findings = [f for f in diagnose(recompute_rows(1_020_000.0, 2523.0)) if f.rule == "kv_recompute"]
    assert findings and findings[0].severity == "info"
    assert "preempts 2,523 sequences a step and prefills 1,020,000 tokens, 102% of the 1,000,000" in (
        findings[0].message
    )
    assert "max_num_seqs" in findings[0].fix and "num_warmup_batches" in findings[0].fix
    assert "headroom_tokens" in findings[0].fix
    # any mode; 500 sequences a step (1 M tokens of 2,000), 40 preempted
    assert "kv_recompute" in rules(recompute_rows(300_000.0, 40.0, partial=False))
    # a step's own prompts: prefilled tokens well under its samples
    assert "kv_recompute" not in rules(recompute_rows(100_000.0, 40.0))
    # tool outputs prefilled into conversations beside a few preemptions (10 of 500 sequences)
    assert "kv_recompute" not in rules(recompute_rows(3_000_000.0, 10.0))
    assert "kv_recompute" not in rules(recompute_rows(400_000.0, 0.0))
    assert "kv_recompute" not in rules(healthy_rows())  # no engine counters (the HF engine)
