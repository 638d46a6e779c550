"""`fulcrum tune`: the levers it probes for a configuration, how it reads a trial's outcome, the search
(best kept, a lever abandoned at its first out-of-memory), and a real CPU run with a tiny model."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from helpers import cpu_ppo_overrides

from fulcrum.config import load_config
from fulcrum.data.synthetic import write_splits
from fulcrum.models.tiny import build_tiny_model
from fulcrum.tools import tune, tune_trial

_spec = importlib.util.spec_from_file_location("_test_config", Path(__file__).with_name("test_config.py"))
_test_config = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_test_config)
seed_command = _test_config.seed_command

MICRO = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"


def test_levers_of_the_seed_command() -> None:
    cfg = load_config(seed_command())
    levers = {lever.name: lever.candidates for lever in tune.levers_for(cfg, on_cuda=True)}
    assert list(levers) == [
        "micro",
        "checkpointing",
        "dynamic",
        "max_num_batched_tokens",
        "gpu_memory_utilization",
    ]
    # 128 responses per device per mini-batch, micro-batch 8 today: 16, 32, 64, 128; forwards at twice that
    assert [c[MICRO] for c in levers["micro"]] == ["16", "32", "64", "128"]
    assert levers["micro"][0]["critic.forward_micro_batch_size_per_gpu"] == "32"
    assert levers["checkpointing"] == [
        {
            "actor_rollout_ref.model.enable_gradient_checkpointing": "False",
            "critic.model.enable_gradient_checkpointing": "False",
        }
    ]
    assert [c["actor_rollout_ref.actor.ppo_max_token_len_per_gpu"] for c in levers["dynamic"]] == [
        "1536",
        "3072",
        "6144",
    ]
    assert levers["gpu_memory_utilization"] == [{"actor_rollout_ref.rollout.gpu_memory_utilization": "0.8"}]
    on_cpu = {lever.name for lever in tune.levers_for(cfg, on_cuda=False)}
    assert "gpu_memory_utilization" not in on_cpu  # the CPU's KV cache is not sized from it
    assert "decode_order" not in levers  # 256-token responses grow together
    waves = load_config([*seed_command(), "actor_rollout_ref.rollout.max_num_seqs=256"])
    assert {"actor_rollout_ref.rollout.max_num_seqs": "512"} in next(
        lever.candidates for lever in tune.levers_for(waves, on_cuda=True) if lever.name == "max_num_seqs"
    )


def test_long_or_partial_rollouts_probe_the_decode_order() -> None:
    """The decode kernel's row order is probed where a decode batch's contexts are uneven: responses of
    LONG_RESPONSE tokens or more, or partial rollouts; on CUDA only, and not when already longest first."""
    key = "actor_rollout_ref.rollout.engine_kwargs.native.decode_order"

    def levers(*extra: str, on_cuda: bool = True) -> dict:
        cfg = load_config([*seed_command(), *extra])
        return {lever.name: lever.candidates for lever in tune.levers_for(cfg, on_cuda=on_cuda)}

    long = f"data.max_response_length={tune.LONG_RESPONSE}"
    assert levers(long)["decode_order"] == [{key: "longest_first"}]
    partial = [
        "trainer.use_v1=True",
        "trainer.v1.trainer_mode=colocate_async",
        "algorithm.adv_estimator=grpo",
    ]
    assert levers(*partial)["decode_order"] == [{key: "longest_first"}]
    assert "decode_order" not in levers(long, on_cuda=False)
    assert "decode_order" not in levers(long, f"+{key}=longest_first")
    cfg = load_config([*seed_command(), long, f"{key}=longest_first"])
    assert cfg.actor_rollout_ref.rollout.engine_kwargs["native"]["decode_order"] == "longest_first"


def test_outcome_of_a_trial() -> None:
    assert tune_trial.classify(0, "step 3 | ...") == "ran"
    oom = "fulcrum train: out of device memory during update_actor: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert tune_trial.classify(1, oom) == "out of memory"
    assert tune_trial.classify(1, "Traceback ...\nValueError: bad thing\n") == "failed: ValueError: bad thing"


def test_search_keeps_the_best_and_stops_a_lever_at_out_of_memory() -> None:
    levers = [
        tune.Lever("micro", [{MICRO: "16"}, {MICRO: "32"}, {MICRO: "64"}, {MICRO: "128"}]),
        tune.Lever("checkpointing", [{"ckpt": "False"}]),
    ]
    ran: list[dict[str, str]] = []

    def fake_run(trial: tune.Trial) -> tune.Trial:
        ran.append(dict(trial.changes))
        micro = int(trial.changes.get(MICRO, 8))
        if micro >= 64 or (micro == 32 and "ckpt" in trial.changes):
            trial.outcome = "out of memory"
            return trial
        trial.outcome, trial.throughput = "ran", 1000.0 * micro
        return trial

    best, trials = tune.search([], levers, fake_run, max_trials=12)
    assert best.changes == {MICRO: "32"}
    assert [t.outcome for t in trials] == ["ran", "ran", "ran", "out of memory", "out of memory"]
    assert {MICRO: "128"} not in ran  # 64 ran out of memory: 128 is not tried
    assert trials[-1].probe == "checkpointing: ckpt=False"
    table = "\n".join(tune.table(trials))
    assert "out of memory" in table and "your configuration" in table


def test_a_configuration_that_runs_out_of_memory_is_shrunk_until_it_fits() -> None:
    cfg = load_config([*seed_command(), "actor_rollout_ref.model.enable_gradient_checkpointing=False"])
    shrink = tune.shrink_lever(cfg)
    assert [c.get(MICRO) for c in shrink.candidates] == [None, "4", "2", "1"]  # checkpointing first
    assert all(
        c["actor_rollout_ref.model.enable_gradient_checkpointing"] == "True" for c in shrink.candidates
    )

    def fake_run(trial: tune.Trial) -> tune.Trial:  # fits from micro-batch 2 on, faster when larger
        micro = int(trial.changes.get(MICRO, 8))
        trial.outcome = "ran" if micro <= 2 else "out of memory"
        trial.throughput = 100.0 * micro if micro <= 2 else None
        return trial

    best, trials = tune.search([], [tune.Lever("micro", [{MICRO: "16"}])], fake_run, 12, shrink)
    assert best.changes[MICRO] == "2"
    assert [t.outcome for t in trials] == [
        "out of memory",
        "out of memory",
        "out of memory",
        "ran",
        "out of memory",
    ]
    assert trials[3].probe.startswith("shrink: model.enable_gradient_checkpointing=True")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tune")
    build_tiny_model(
        root / "model",
        intermediate_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    write_splits(root / "data", num_train=16, num_test=4)
    return root


def test_tune_on_the_cpu_with_a_tiny_model(assets: Path, tmp_path: Path, capsys) -> None:
    argv = [
        f"data.train_files={assets}/data/train.parquet",
        f"data.val_files={assets}/data/test.parquet",
        "data.train_batch_size=8",
        "data.max_prompt_length=128",
        "data.max_response_length=8",
        f"actor_rollout_ref.model.path={assets}/model",
        f"critic.model.path={assets}/model",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        f"{MICRO}=2",
        "critic.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.device=cpu",
        "trainer.n_gpus_per_node=1",
    ]
    code = tune.main([*argv, "--max-trials", "1", "--steps", "1", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [line for line in out.splitlines() if line[:2].strip().isdigit()]
    assert len(rows) == 1 and " ran " in rows[0] and "your configuration" in rows[0], out
    throughput, peak = rows[0].split()[1:3]
    assert float(throughput) > 0 and float(peak) > 0  # the trainer's own perf/ metrics, read back
    assert "fastest that fits: your configuration" in out
    assert (tmp_path / "trial-0" / "metrics.jsonl").is_file()
    assert not list(tmp_path.glob("trial-*/global_step_*"))  # probes write no checkpoint


def test_main_prints_the_overrides_of_the_fastest_trial_that_fits(
    monkeypatch, capsys, tmp_path: Path
) -> None:
    """The search and the printing, with each trial's training replaced by figures (micro 32 runs out of memory)."""

    def fake_trial(
        base: list[str], trial: tune.Trial, work: Path, steps: int, timeout: float, budget_left: float | None
    ) -> tune.Trial:
        micro = int(trial.changes.get(MICRO, 8))
        if micro >= 32:
            trial.outcome = "out of memory"
        else:
            trial.outcome, trial.throughput, trial.peak_memory_gb = "ran", 100.0 * micro, 10.0 + micro
        return trial

    monkeypatch.setattr(tune, "run_trial", fake_trial)
    code = tune.main([*seed_command(), "--levers", "micro", "--work-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0
    assert "out of memory" in out and "   1600.0" in out
    assert "fastest that fits: 1600.0 tok/s/device, 2.00x your configuration; add these overrides:" in out
    assert (
        out.strip()
        .splitlines()[-1]
        .startswith(f"{MICRO}=16 actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32")
    )


def test_time_budget_stops_the_search_and_prints_what_was_found(monkeypatch, capsys, tmp_path: Path) -> None:
    """Fake trials of 40, 25 and 45 s against a 100 s budget (a fake clock): the third starts (35 s left,
    more than the quickest trial) and is cut short, and none starts after it; the table, trials.json and
    the best overrides of the two that ran are still printed. A trial is not started when the time left
    is below the quickest trial so far."""
    clock = [0.0]
    monkeypatch.setattr(tune.time, "monotonic", lambda: clock[0])
    started: list[float | None] = []

    def fake_trial(
        base: list[str], trial: tune.Trial, work: Path, steps: int, timeout: float, budget_left: float | None
    ) -> tune.Trial:
        started.append(budget_left)
        assert budget_left is not None
        needs = (40.0, 25.0, 45.0)[len(started) - 1]
        spent = min(needs, budget_left)
        clock[0] += spent
        trial.seconds = spent
        if spent < needs:
            trial.outcome = tune.STOPPED
        else:
            micro = int(trial.changes.get(MICRO, 8))
            trial.outcome, trial.throughput = "ran", 100.0 * micro
        return trial

    monkeypatch.setattr(tune, "run_trial", fake_trial)
    code = tune.main(
        [
            *seed_command(),
            "--levers",
            "micro",
            "--max-trials",
            "12",
            "--time-budget",
            "100",
            "--work-dir",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert started == [100.0, 60.0, 35.0]  # the budget left handed to each trial; no fourth trial
    assert "--time-budget 100 s spent after 3 trials" in out
    assert tune.STOPPED in out
    assert "fastest that fits: 1600.0 tok/s/device, 2.00x your configuration" in out
    assert out.strip().splitlines()[-1].startswith(f"{MICRO}=16 ")
    record = json.loads((tmp_path / "trials.json").read_text())
    assert [r["outcome"] for r in record] == ["ran", "ran", tune.STOPPED]


def test_a_trial_past_the_time_budget_is_stopped(assets: Path, tmp_path: Path) -> None:
    """A real trial (the trainer in its own process) given 2 s of budget is stopped, not waited for."""
    # a valid run (the helpers' CPU PPO set): it must be stopped by the budget, not refused at start
    argv = cpu_ppo_overrides(assets, tmp_path / "run", {"trainer.total_training_steps": 50})
    trial = tune.run_trial(argv, tune.Trial({}), tmp_path, steps=50, timeout=900.0, budget_left=2.0)
    assert trial.outcome == tune.STOPPED
    assert trial.throughput is None  # no warm step was measured
    assert trial.log is not None and trial.log.is_file()


def test_trial_figures_are_read_from_the_warm_steps(tmp_path: Path) -> None:
    rows = [
        {"perf/throughput": 10.0, "timing_s/step": 9.0, "perf/max_memory_reserved_gb": 50.0},
        {
            "perf/throughput": 100.0,
            "timing_s/step": 2.0,
            "perf/max_memory_reserved_gb": 60.0,
            "perf/max_memory_allocated_gb/gen": 55.0,
            "perf/max_memory_allocated_gb/update_actor": 20.0,
            "perf/max_memory_allocated_gb/values": 12.0,
        },
    ]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + '\n{"perf/thr')
    trial = tune_trial.measure(tmp_path, tune.Trial({}))
    assert (trial.throughput, trial.step_seconds, trial.peak_memory_gb) == (100.0, 2.0, 60.0)
    assert trial.train_memory_gb == 20.0  # generation's KV cache left out
    assert trial.phases["perf/max_memory_allocated_gb/update_actor"] == 20.0
    (tmp_path / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    assert tune_trial.measure(tmp_path, tune.Trial({}), warm_only=True).throughput is None
    assert tune_trial.measure(tmp_path, tune.Trial({})).throughput == 10.0
