"""Two CPU processes (gloo, as torchrun starts them) train one run: the same step as one process.

Greedy rollout, so both runs see the same responses; every loss, grad norm and the saved weights must
agree with the one-process run, and only rank 0 writes the run directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import cpu_ppo_overrides, make_assets
from helpers_dist import free_port, run_ranks
from safetensors.torch import load_file

from fulcrum.config.compat import FSDP_ROLES
from fulcrum.trainer.main_ppo import main

COMPARED = (
    "actor/pg_loss",
    "actor/kl_loss",
    "actor/grad_norm",
    "actor/entropy",
    "critic/vf_loss",
    "critic/grad_norm",
)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_assets(tmp_path_factory.mktemp("dp"), num_train=4, num_test=2)


def overrides(assets: Path, run_dir: Path, engine: dict[str, object]) -> list[str]:
    keys = {
        **engine,
        "data.train_batch_size": 4,
        "data.max_response_length": 8,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
        "actor_rollout_ref.rollout.do_sample": False,
        "actor_rollout_ref.actor.use_kl_loss": True,  # a reference policy too
        "trainer.n_gpus_per_node": 2,
        "trainer.total_training_steps": 2,
        "trainer.save_freq": 1,
        "trainer.val_before_train": False,
        "trainer.logger": "[console]",
    }
    return cpu_ppo_overrides(assets, run_dir, keys)


def _train(rank: int, world: int, args: list[str]) -> int:
    return main(args)


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# hf: each process generates half of the prompts; native with tensor_model_parallel_size=2: the two
# processes run one engine (heads and MLP split), weights synced into it as shards after each update.
ENGINES = {
    "hf-data-parallel": {"actor_rollout_ref.rollout.name": "hf"},
    "native-tensor-parallel": {
        "actor_rollout_ref.rollout.name": "native",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
    },
}


# Each model replicated on both ranks (verl's fsdp_size=1; on the CPU the default shards them).
REPLICATED: dict[str, object] = {f"{role}.fsdp_config.fsdp_size": 1 for role in FSDP_ROLES}


@pytest.mark.parametrize(
    "engine, layout",
    [
        ("hf-data-parallel", "sharded"),
        ("native-tensor-parallel", "sharded"),
        ("hf-data-parallel", "replicated"),
    ],
)
def test_two_processes_take_the_same_steps_as_one(
    assets: Path, tmp_path: Path, engine: str, layout: str
) -> None:
    torch.set_num_threads(1)
    keys = {**ENGINES[engine], **(REPLICATED if layout == "replicated" else {})}
    assert main(overrides(assets, tmp_path / "one", keys)) == 0
    assert run_ranks(_train, 2, overrides(assets, tmp_path / "two", keys)) == [0, 0]
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["training/global_step"] for r in two] == [1, 2]  # one row per step: rank 0 alone logs
    for a, b in zip(one, two, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), key
        assert b["response_length/mean"] == a["response_length/mean"]
        # One epoch, one mini-batch: the update gave the old log-probs (each rank its rows, gathered),
        # so the pass ran in neither, and its metrics still agree.
        assert a["timing_s/old_log_prob"] == b["timing_s/old_log_prob"] == 0.0
        assert b["rollout/logprob_diff_mean"] == pytest.approx(a["rollout/logprob_diff_mean"], abs=1e-6)
    saved = [load_file(tmp_path / run / "global_step_2/actor/model.safetensors") for run in ("one", "two")]
    assert saved[0].keys() == saved[1].keys()
    for name, weight in saved[0].items():
        torch.testing.assert_close(saved[1][name], weight, atol=1e-5, rtol=1e-5, msg=name)


def test_a_two_rank_checkpoint_resumes_exactly_on_two_ranks_and_on_one(assets: Path, tmp_path: Path) -> None:
    torch.set_num_threads(1)
    # a learning rate at which Adam's restored moments show in the weights after one more step
    engine = {**ENGINES["hf-data-parallel"], "actor_rollout_ref.actor.optim.lr": 1e-3}
    assert run_ranks(_train, 2, overrides(assets, tmp_path / "two", engine)) == [0, 0]
    resume = [
        "trainer.resume_mode=resume_path",
        f"trainer.resume_from_path={tmp_path / 'two' / 'global_step_1'}",
    ]
    assert run_ranks(_train, 2, [*overrides(assets, tmp_path / "again", engine), *resume]) == [0, 0]
    # one process (the world size is a harmless change on resume)
    assert main([*overrides(assets, tmp_path / "single", engine), *resume, "trainer.n_gpus_per_node=1"]) == 0
    uninterrupted = rows(tmp_path / "two")[1]
    for run in ("again", "single"):
        resumed = rows(tmp_path / run)
        assert [r["training/global_step"] for r in resumed] == [2], run
        for key in COMPARED:
            assert resumed[0][key] == pytest.approx(uninterrupted[key], abs=1e-5, rel=1e-5), (run, key)
        # the weights after the resumed step: the optimiser state came back too
        after = load_file(tmp_path / run / "global_step_2/actor/model.safetensors")
        for name, weight in load_file(tmp_path / "two/global_step_2/actor/model.safetensors").items():
            torch.testing.assert_close(after[name], weight, atol=1e-5, rtol=1e-5, msg=f"{run}: {name}")


@pytest.mark.slow
def test_two_torchrun_nodes_on_localhost_take_the_same_steps_as_one(assets: Path, tmp_path: Path) -> None:
    """The multi-machine case: two `torchrun --nnodes=2 --nproc_per_node=1` launches meet at a c10d
    rendezvous on localhost and train one run."""
    torch.set_num_threads(1)
    engine = ENGINES["hf-data-parallel"]
    assert main(overrides(assets, tmp_path / "one", engine)) == 0
    args = [*overrides(assets, tmp_path / "two", engine), "trainer.n_gpus_per_node=1", "trainer.nnodes=2"]
    endpoint = f"localhost:{free_port()}"
    launch = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1"]
    launch += ["--rdzv_backend=c10d", f"--rdzv_endpoint={endpoint}", "-m", "fulcrum.trainer.main_ppo", *args]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    nodes = [
        subprocess.Popen(launch, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for _ in range(2)
    ]
    try:
        outputs = [node.communicate(timeout=600)[0].decode() for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        tails = [node.communicate()[0].decode()[-2000:] for node in nodes]
        raise AssertionError("the two nodes did not finish (hung?):\n" + "\n---\n".join(tails)) from None
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-2000:] + outputs[1][-2000:]
    assert sum("× 2 machine(s)" in out for out in outputs) == 1  # rank 0's summary, on one of them
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    for a, b in zip(one, two, strict=True):
        for key in COMPARED:
            assert b[key] == pytest.approx(a[key], abs=1e-5, rel=1e-5), key


def test_start_up_summary_names_the_world_size_and_each_share():
    from fulcrum.config import load_config
    from fulcrum.parallel import DistInfo
    from fulcrum.trainer.data_parallel import startup_line

    cfg = load_config(["data.train_batch_size=7", "actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert startup_line(DistInfo(), cfg) is None  # one process: nothing to say
    line = startup_line(DistInfo(0, 4, 0, 2, "nccl"), cfg, tp_size=2)
    assert line is not None and line.startswith(
        "world size 4 (2 process(es) per machine × 2 machine(s), nccl)"
    )
    assert "each engine of 2 tensor-parallel ranks generates 3-4 of the 7 prompts" in line
    assert "on 1-2 of the 7 responses, and 1 of every mini-batch of 4" in line


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_two_gpus_train_like_one(assets: Path, tmp_path: Path, layout: str) -> None:
    """Each model replicated (the default for a small model on a GPU: one gradient all-reduce per
    optimiser step) or FSDP2-sharded (fsdp_size=2), over NCCL with bf16 compute and one TP=2 native
    engine (CUDA graphs, Triton kernels): the same steps as one GPU, up to bf16 rounding."""
    sharded = {k: 2 for k in REPLICATED} if layout == "sharded" else {}
    gpu = {
        "actor_rollout_ref.rollout.name": "native",
        "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
        "trainer.device": "cuda",
        **sharded,
    }
    assert main([*overrides(assets, tmp_path / "one", gpu), "trainer.n_gpus_per_node=1"]) == 0
    assert run_ranks(_train, 2, overrides(assets, tmp_path / "two", gpu), device="cuda") == [0, 0]
    one, two = rows(tmp_path / "one"), rows(tmp_path / "two")
    assert [r["training/global_step"] for r in two] == [1, 2]
    for a, b in zip(one, two, strict=True):
        for key in ("actor/grad_norm", "critic/grad_norm", "critic/vf_loss", "actor/entropy"):
            assert b[key] == pytest.approx(a[key], rel=0.05), key
