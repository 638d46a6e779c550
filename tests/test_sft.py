"""`fulcrum sft`: verl's keys, response-only loss, a loss that goes down, a folder transformers loads."""

import json
import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from fulcrum.config import ConfigError
from fulcrum.data.synthetic import ArithmeticTask, write_splits
from fulcrum.models.tiny import build_tiny_model
from fulcrum.trainer.sft import (
    SFTDataConfig,
    SFTExample,
    collate,
    load_examples,
    load_sft_config,
    main,
    response_token_nll,
    run_sft,
)
from fulcrum.workers.optim import lr_schedule


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    model = build_tiny_model(
        root / "model", seed=0, hidden_size=64, num_hidden_layers=2, intermediate_size=128
    )
    train, test = write_splits(
        root / "data", num_train=96, num_test=16, seed=0, task=ArithmeticTask(max_operand=9)
    )
    return root, model, train, test


def test_overrides_in_verl_spelling():
    cfg = load_sft_config(
        [
            "data.train_files=a.parquet",
            "model.partial_pretrain=m",
            "optim.lr=1e-4",
            "+data.prompt_dict_keys=['question']",
            "data.response_dict_keys=[answer]",
            "trainer.logger=['console','wandb']",
            "trainer.total_training_steps=null",
            "model.fsdp_config.cpu_offload=True",
        ]
    )
    assert cfg.optim.lr == 1e-4 and cfg.data.prompt_dict_keys == ["question"]
    assert cfg.data.response_dict_keys == ["answer"] and cfg.trainer.logger == ["console", "wandb"]
    assert cfg.trainer.total_training_steps is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.micro_batch_size_per_gpuu=2", "did you mean data.micro_batch_size_per_gpu"),
        ("optim.lr=fast", "optim.lr"),
        ("data.truncation=middle", "data.truncation"),
        ("data.train_batch_size=6", "divisible"),
        ("model.lora_rank=8", "model.lora_rank"),
    ],
)
def test_bad_keys_and_values_are_named(override, message):
    base = ["data.train_files=a.parquet", "model.partial_pretrain=m"]
    with pytest.raises(ConfigError, match=message):
        load_sft_config([*base, override])


def test_required_keys():
    with pytest.raises(ConfigError, match=r"data\.train_files"):
        load_sft_config(["model.partial_pretrain=m"])
    with pytest.raises(ConfigError, match=r"model\.partial_pretrain"):
        load_sft_config(["data.train_files=a.parquet"])


def test_collate_masks_exactly_the_response():
    ids, attn, mask = collate([SFTExample([5, 6, 7, 8], 2), SFTExample([1, 2, 3], 1)], pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8], [1, 2, 3, 0]]
    assert attn.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert mask.tolist() == [[0, 0, 1, 1], [0, 1, 1, 0]]


def test_response_token_nll_by_hand():
    # Two tokens of vocabulary 2; logits at position 0 predict token 1, whose target is 1 and counts.
    logits = torch.tensor([[[0.0, math.log(3.0)], [5.0, 5.0]]])  # p(token 1 | pos 0) = 3/4
    ids = torch.tensor([[0, 1]])
    assert response_token_nll(logits, ids, torch.tensor([[0, 1]])).item() == pytest.approx(-math.log(0.75))
    assert (
        response_token_nll(logits, ids, torch.tensor([[1, 0]])).item() == 0.0
    )  # the prompt is never a target


def test_examples_use_the_chat_template_and_dict_columns(tiny):
    _, model, train, _ = tiny
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    cfg = SFTDataConfig(prompt_key="prompt", response_key="extra_info", response_dict_keys=["answer"])
    examples = load_examples(str(train), tok, cfg)
    row = pq.read_table(train).to_pylist()[0]
    prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    first = examples[0]
    assert tok.decode(first.input_ids[: first.num_prompt_tokens]) == prompt
    assert (
        tok.decode(first.input_ids[first.num_prompt_tokens :]) == row["extra_info"]["answer"] + tok.eos_token
    )
    # verl's GSM8K recipe: question and answer both from the extra_info dict.
    plain = load_examples(str(train), tok, SFTDataConfig(prompt_key="extra_info", response_key="extra_info"))
    assert row["extra_info"]["question"] in tok.decode(plain[0].input_ids)


def test_data_errors_name_file_row_and_column(tiny, tmp_path):
    _, model, train, _ = tiny
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    with pytest.raises(ValueError, match=r"no column 'nope'"):
        load_examples(str(train), tok, SFTDataConfig(prompt_key="nope", response_key="extra_info"))
    with pytest.raises(FileNotFoundError, match=r"missing\.parquet"):
        load_examples(str(tmp_path / "missing.parquet"), tok, SFTDataConfig())
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"question": ["what?"], "answer": ["x" * 400]}), bad)
    with pytest.raises(ValueError, match=r"bad.parquet row 0: \d+ tokens > data.max_length=32"):
        load_examples(str(bad), tok, SFTDataConfig(max_length=32, prompt_dict_keys=[], response_dict_keys=[]))
    right = load_examples(str(bad), tok, SFTDataConfig(max_length=32, truncation="right"))
    assert len(right[0].input_ids) == 32


def test_short_run_lowers_the_loss_and_writes_a_loadable_folder(tiny, tmp_path):
    _, model, train, test = tiny
    torch.manual_seed(0)
    out = tmp_path / "run"
    cfg = load_sft_config(
        [
            f"data.train_files={train}",
            f"data.val_files={test}",
            "data.prompt_key=prompt",
            "data.response_key=extra_info",
            "data.train_batch_size=16",
            "data.micro_batch_size_per_gpu=16",
            f"model.partial_pretrain={model}",
            "optim.lr=1e-2",
            "optim.lr_scheduler=constant",
            "trainer.total_epochs=2",  # 96 // 16 = 6 steps an epoch
            f"trainer.default_local_dir={out}",
            "trainer.device=cpu",
        ]
    )
    result = run_sft(cfg, log=lambda *_: None)
    assert len(result.train_losses) == 12
    assert sum(result.train_losses[-3:]) / 3 < 0.6 * result.train_losses[0], result.train_losses
    assert result.val_loss is not None and result.val_loss < result.train_losses[0]
    assert result.model_dir == out / "global_step_12"
    # Checkpoints are written under a hidden name and renamed whole: none is left half-written.
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["global_step_12"]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13)) and "val/loss" in rows[-1]
    # optim.warmup_steps_ratio=0.1 of 12 steps = 1 warm-up step (at lr/1), then constant.
    assert [r["train/lr"] for r in rows[:3]] == [1e-2, 1e-2, 1e-2]
    assert (out / "config.yaml").is_file()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(result.model_dir)
    tok = AutoTokenizer.from_pretrained(result.model_dir)
    assert tok.eos_token == "<|im_end|>" and tok.chat_template
    assert (result.model_dir / "model.safetensors").is_file()
    ids = torch.tensor([tok.encode("Mia has 3 apples.")])
    assert torch.isfinite(loaded(input_ids=ids).logits).all()


def test_lr_schedule_warms_the_first_step():
    """SFT's schedule: warm-up step s trains at (s + 1) / warmup of the peak lr, then cosine or constant."""

    def factors(style: str, warmup: int, total: int) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        schedule = lr_schedule(optimizer, style, warmup, total, warm_first_step=True)
        out = []
        for _ in range(total):
            out.append(schedule.get_last_lr()[0])
            optimizer.step()
            schedule.step()
        return out

    cosine = factors("cosine", 2, 10)
    assert cosine[:3] == [0.5, 1.0, 1.0] and cosine[6] == pytest.approx(0.5)
    assert factors("constant", 0, 10)[9] == 1.0


def test_main_reports_bad_keys(capsys):
    assert main(["data.train_files=a.parquet", "model.partial_pretrain=m", "optim.lrr=1"]) == 1
    assert "did you mean optim.lr" in capsys.readouterr().err


def _sft_args(model, train, out, *extra):
    return [
        f"data.train_files={train}",
        "data.prompt_key=prompt",
        "data.response_key=extra_info",
        "data.train_batch_size=8",
        "data.micro_batch_size_per_gpu=8",
        f"model.partial_pretrain={model}",
        "trainer.device=cpu",
        f"trainer.default_local_dir={out}",
        *extra,
    ]


def test_a_nan_loss_stops_the_run_without_a_nan_checkpoint(tiny, tmp_path, capsys):
    """An lr of 1e30 blows the weights up at step 1: the later steps' loss is NaN. Their updates are
    skipped, the run stops after trainer.max_nan_steps of them with one line and exit 1, and every
    checkpoint it wrote holds finite weights."""
    from safetensors.torch import load_file

    _, model, train, _ = tiny
    out = tmp_path / "run"
    args = _sft_args(
        model, train, out, "optim.lr=1e30", "optim.warmup_steps_ratio=0", "optim.lr_scheduler=constant"
    )
    assert main([*args, "trainer.total_training_steps=8", "trainer.save_freq=1"]) == 1
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and "trainer.max_nan_steps=3" in last and "optim.lr" in last, err
    assert not (out / "global_step_8").exists()
    saved = sorted(out.glob("global_step_*/model.safetensors"))
    assert saved, "step 1 (finite) is saved"
    for path in saved:
        assert all(torch.isfinite(t).all() for t in load_file(path).values()), path
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["training/nan_skipped_steps"] == 3


def test_empty_data_and_zero_max_length_are_one_line(tiny, tmp_path, capsys):
    _, model, train, _ = tiny
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(train).slice(0, 0), empty)
    assert main(_sft_args(model, empty, tmp_path / "a")) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == f"fulcrum sft: data.train_files: {empty} has no rows"
    assert "Traceback" not in err
    assert main(_sft_args(model, train, tmp_path / "b", f"data.val_files={empty}")) == 1
    assert "data.val_files" in capsys.readouterr().err
    for truncation in ("error", "right"):
        args = _sft_args(model, train, tmp_path / "c", "data.max_length=0", f"data.truncation={truncation}")
        assert main(args) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "data.max_length" in err[0], err


def test_right_truncation_inside_the_prompt_is_handled(tiny):
    """A max_length shorter than the prompt cuts it: the example keeps no loss target instead of failing."""
    _, model, train, _ = tiny
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    cfg = SFTDataConfig(prompt_key="prompt", response_key="extra_info", max_length=4, truncation="right")
    examples = load_examples(str(train), tok, cfg)
    _, _, mask = collate(examples[:2], tok.pad_token_id)
    assert mask.shape == (2, 4) and int(mask.sum()) == 0
