"""Is the native engine right on real weights? Greedy native generation against Hugging Face `generate`
on GSM8K prompts, and the engine's log-probs against the HF forward of the same tokens.

    python bench/real_parity.py --model MODEL_DIR --data DATA/test.parquet --device cuda   # bf16 on a GPU
    python bench/real_parity.py --model MODEL_DIR --data DATA/test.parquet --device cpu --dtype float32

For the first `--prompts` test problems (as the RL data set renders them: chat template, generation
prompt), both engines decode greedily up to `--max-tokens`, stopping at EOS. Reported:
- the share of sequences that are identical, and of response positions whose token agrees (over the
  shorter of the two responses);
- for each sequence that differs, where it first differs and, from the HF forward in float32 on the
  shared prefix, the gap between the two best next-token log-probs there: a gap near zero means the
  two engines took different sides of a near-tie, which is what bf16 rounding does; a large gap
  would be a bug;
- the engine's per-token log-probs against the HF forward (`rollout/logprob_diff_mean` and max, the
  training run's metric) over the engine's own responses.
The float32 run (CPU) shows what remains without bf16 rounding.

`--lm-head-fp32 off,on` adds, per setting of `actor_rollout_ref.model.lm_head_fp32`, a sampled rollout
(temperature 1, seeded, as in training) and its log-prob gap to the HF forward and to the training
path's packed forward (`forward_batch` with a `LogProbHead`), both sides with the same setting
(`lm_head_fp32/<off|on>/...`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fulcrum.models.head_logits import head_logits
from fulcrum.models.packed import enable_packed_attention
from fulcrum.rollout import SamplingParams
from fulcrum.rollout.native import EngineConfig, NativeEngine
from fulcrum.rollout.testing import scoring_batch
from fulcrum.workers.forwards import LogProbHead, forward_batch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def gsm8k_prompts(tokenizer, data: Path, count: int) -> list[list[int]]:
    rows = pq.read_table(data).slice(0, count).to_pylist()
    texts = [
        tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in rows
    ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def hf_greedy(
    model, prompts: list[list[int]], max_tokens: int, eos: int, pad: int, device
) -> list[list[int]]:
    """HF `generate`, greedy, left-padded batches; each response cut after its first EOS (kept)."""
    out: list[list[int]] = []
    for start in range(0, len(prompts), 64):
        batch = prompts[start : start + 64]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.no_grad():
            gen = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=max_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
            )
        for row in gen[:, width:].tolist():
            out.append(row[: row.index(eos) + 1] if eos in row else row)
    return out


def next_token_gaps(model, prompt: list[int], response: list[int], device) -> torch.Tensor:
    """(len(response),) float32 log-prob gap between the best and second-best next token at each response
    position, from a float32 forward of prompt + response."""
    ids = torch.tensor([prompt + response], device=device)
    with torch.no_grad(), torch.autocast(device_type=device.type, enabled=False):
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    top = logits.log_softmax(-1).topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).cpu()


def forward_logprobs(model, prompt: list[int], response: list[int], device) -> torch.Tensor:
    """(len(response),) log-probs of the response tokens under the HF forward in the model's dtype."""
    ids = torch.tensor([prompt + response], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response, device=device)[:, None])[:, 0].cpu()


def head_logprobs(model, prompt: list[int], response: list[int], device, fp32: bool) -> torch.Tensor:
    """`forward_logprobs` with the LM head applied by `head_logits` (float32 output with `fp32`)."""
    ids = torch.tensor([prompt + response], device=device)
    head = model.get_output_embeddings()
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state[0, len(prompt) - 1 : -1]
        logits = head_logits(hidden, head.weight, head.bias, fp32).float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(response, device=device)[:, None])[:, 0].cpu()


def lm_head_fp32_gaps(
    model, packed_model, prompts: list[list[int]], config: EngineConfig, eos: int, pad: int, args, fp32: bool
) -> dict[str, float]:
    """Mean and max |engine − HF forward| and |engine − training path| over a sampled rollout, both
    sides with `lm_head_fp32=fp32`."""
    device = torch.device(args.device)
    config = EngineConfig(**{**config.__dict__, "lm_head_fp32": fp32})
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=0)
    out = NativeEngine(model, [eos], pad, config, device).generate(prompts, params)
    rows = [(p, r, lp) for p, r, lp in zip(prompts, out.token_ids, out.logprobs, strict=True) if r]
    hf = torch.cat([(torch.tensor(lp) - head_logprobs(model, p, r, device, fp32)).abs() for p, r, lp in rows])
    batch = scoring_batch([p for p, _, _ in rows], [r for _, r, _ in rows])
    trained = []
    for start in range(0, len(rows), 16):
        mb = batch.select(list(range(start, min(start + 16, len(rows)))))
        with torch.no_grad():
            head = LogProbHead(1.0, fp32_logits=fp32)
            logp = forward_batch(packed_model, mb, head, device, packed=True)[0]
        engine = torch.zeros_like(logp)
        for i, (_, _, lp) in enumerate(rows[start : start + 16]):
            engine[i, : len(lp)] = torch.tensor(lp, device=engine.device)
        trained.append((engine - logp)[mb["response_mask"].to(logp.device).bool()].abs().cpu())
    train = torch.cat(trained)
    name = "on" if fp32 else "off"
    return {
        f"lm_head_fp32/{name}/hf_forward_diff_mean": round(float(hf.mean()), 6),
        f"lm_head_fp32/{name}/hf_forward_diff_max": round(float(hf.max()), 6),
        f"lm_head_fp32/{name}/training_path_diff_mean": round(float(train.mean()), 6),
        f"lm_head_fp32/{name}/training_path_diff_max": round(float(train.max()), 6),
    }


def compare(native: list[list[int]], hf: list[list[int]]) -> tuple[dict, list[tuple[int, int]]]:
    """Agreement figures and, per differing sequence, (sequence, first differing position)."""
    same_positions = total_positions = identical = 0
    first_diffs: list[tuple[int, int]] = []
    for i, (a, b) in enumerate(zip(native, hf, strict=True)):
        shorter = min(len(a), len(b))
        agree = sum(x == y for x, y in zip(a[:shorter], b[:shorter], strict=True))
        same_positions += agree
        total_positions += shorter
        if a == b:
            identical += 1
            continue
        first = next((k for k in range(shorter) if a[k] != b[k]), shorter)
        first_diffs.append((i, first))
    return {
        "sequences": len(native),
        "identical_sequences": identical,
        "identical_share": identical / len(native),
        "token_agreement": same_positions / max(total_positions, 1),
        "first_difference_positions": sorted(k for _, k in first_diffs),
    }, first_diffs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True, help="a verl-format GSM8K parquet (test split)")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    parser.add_argument("--out", type=Path, help="write the JSON summary here too")
    parser.add_argument(
        "--lm-head-fp32", default="", help="comma-separated off,on: the sampled-rollout gaps per setting"
    )
    args = parser.parse_args(argv)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    prompts = gsm8k_prompts(tokenizer, args.data, args.prompts)

    config = EngineConfig(
        max_num_seqs=args.prompts,
        max_model_len=max(len(p) for p in prompts) + args.max_tokens + 16,
        gpu_memory_utilization=0.2,
        dtype=dtype,
    )
    tick = time.perf_counter()
    engine = NativeEngine(model, [eos], pad, config, device)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
    native_s = time.perf_counter() - tick
    tick = time.perf_counter()
    hf = hf_greedy(model, prompts, args.max_tokens, eos, pad, device)
    hf_s = time.perf_counter() - tick

    summary, first_diffs = compare(out.token_ids, hf)
    reference = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).to(device).eval()
    gaps = []
    for i, k in first_diffs:
        shared = out.token_ids[i][:k]
        gap = next_token_gaps(reference, prompts[i], [*shared, out.token_ids[i][k]], device)[-1]
        gaps.append(round(float(gap), 5))
    summary["fp32_top2_gap_at_first_difference"] = gaps
    all_gaps = torch.cat([next_token_gaps(reference, p, r, device) for p, r in zip(prompts, hf, strict=True)])
    summary["fp32_top2_gap_median_all_positions"] = round(float(all_gaps.median()), 4)
    diffs = [
        (torch.tensor(lp) - forward_logprobs(model, p, r, device)).abs()
        for p, r, lp in zip(prompts, out.token_ids, out.logprobs, strict=True)
        if r
    ]
    gap = torch.cat(diffs)
    summary["rollout/logprob_diff_mean"] = round(float(gap.mean()), 6)
    summary["rollout/logprob_diff_max"] = round(float(gap.max()), 6)
    if args.lm_head_fp32:
        packed_model = AutoModelForCausalLM.from_pretrained(
            args.model, dtype=dtype, attn_implementation="sdpa"
        )
        packed_model = packed_model.to(device).eval()
        enable_packed_attention(packed_model)
        for setting in args.lm_head_fp32.split(","):
            fp32 = {"off": False, "on": True}[setting.strip()]
            summary.update(lm_head_fp32_gaps(model, packed_model, prompts, config, eos, pad, args, fp32))
    summary.update(
        model=str(args.model),
        device=str(device),
        dtype=args.dtype,
        max_tokens=args.max_tokens,
        mean_response_tokens=round(statistics.fmean(len(r) for r in out.token_ids), 1),
        native_s=round(native_s, 2),
        hf_s=round(hf_s, 2),
    )
    text = json.dumps(summary)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
