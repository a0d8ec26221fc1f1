"""An independent implementation on the long-horizon family: TRL's ``DistillationTrainer`` from the same pinned SFT
student and teacher, on the same prompts, at OPD's settings, scored by our evaluation on the same curve prompts
(does OPD's failure to rise from its start belong to the method in this regime, or to our code?).

Run it in the workspace that ``studies/opd_ablation.sh`` built (the pinned student ``data/study/long_horizon_sft_init``,
the models stage's teacher and the teacher_gen splits, with the study's params applied), with trl installed (for
benchmarks only, never at run time: ``make trl``):

    python studies/trl_replication.py --seeds 1 2 3 --steps 300 > trl.jsonl

Matched to the ablation's ``default`` arm (the params' ``opd`` section, read from params.yaml):

- the student and teacher weights and the tokenizer; the prompts (the rows ``train_rows`` gives the opd stage),
  rendered by the same chat template with the generation prompt;
- one on-policy completion per prompt (TRL's trainer is always on-policy), ``opd.global_batch_size`` prompts per
  step (one process, no accumulation), up to ``opd.max_new_tokens`` tokens, sampled at ``opd.sample_temperature``,
  top-p 1, top-k off;
- the divergence: generalised JSD at ``opd.beta`` (1 = reverse KL) at ``opd.temperature``, over the whole
  vocabulary, summed over completion tokens and divided by the batch's completion tokens (as ours); TRL samples
  and scores at one temperature, so the two opd temperatures must be equal;
- the optimiser and schedule: ours, handed to TRL (``make_optimizer``/``make_scheduler``: AdamW with the params'
  betas, eps and weight decay, no decay on norms and biases, linear warmup, cosine to ``min_lr_ratio``); the
  gradient clip ``opd.max_grad_norm``; fp32, no gradient checkpointing.

Not matched: the data order and the sampling draws (TRL's seeded sampler and ``generate``), so a TRL seed is not
our seed; pair by arm, not by seed. Scoring: greedy exact match on the first ``evaluate.curve_examples`` held-out
prompts with ``evaluate.max_new_tokens``, checked as the evaluate stage checks (the ablation's curve points), at
the start and after the last step. One JSON line per seed:
``{"seed", "steps", "start_exact_match", "end_exact_match", "change", "per_task_start", "per_task_end", "train_s"}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from ars_opd.artifacts import read_jsonl  # noqa: E402
from ars_opd.config import load_params  # noqa: E402
from ars_opd.data import synthetic  # noqa: E402
from ars_opd.data.prompts import encode_prompts  # noqa: E402
from ars_opd.lm.generation import decode_completion, eos_token_ids, generate_token_ids  # noqa: E402
from ars_opd.lm.optim import make_optimizer, make_scheduler  # noqa: E402
from ars_opd.models.loading import load_tokenizer, model_path  # noqa: E402
from ars_opd.training.train_rows import train_rows  # noqa: E402

INIT = "data/study/long_horizon_sft_init"


def exact_match(model, tokenizer, rows: list[dict], max_new_tokens: int) -> tuple[float, dict[str, float]]:
    """Greedy exact match over ``rows`` (checkable ones), overall and per task, as the evaluate stage scores."""
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
    eos = eos_token_ids(model, tokenizer)
    greedy = generate_token_ids(model, tokenizer, prompts, max_new_tokens, batch_size=64, eos_ids=eos)
    per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r, ids in zip(rows, greedy):
        text = decode_completion(tokenizer, ids, eos)
        per_task[r["task"]][0] += int(synthetic.is_correct_for(r["task"], text, r["reference"]))
        per_task[r["task"]][1] += 1
    total = sum(c for c, _ in per_task.values()) / sum(n for _, n in per_task.values())
    return total, {k: c / n for k, (c, n) in sorted(per_task.items())}


def run_seed(seed: int, steps: int, params, init: Path, curve_rows: list[dict], threads: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import DistillationConfig, DistillationTrainer

    torch.set_num_threads(threads)
    opd, ev, paths = params.opd, params.evaluate, params.paths
    if opd.sample_temperature != opd.temperature:  # TRL samples and scores at one temperature
        raise SystemExit(
            f"TRL uses one temperature for sampling and the loss; opd.sample_temperature {opd.sample_temperature} "
            f"!= opd.temperature {opd.temperature}"
        )
    tokenizer = load_tokenizer(paths.models_dir)
    student = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    teacher = AutoModelForCausalLM.from_pretrained(model_path(paths.models_dir, "teacher"), dtype=torch.float32)
    teacher = teacher.eval()
    start, start_tasks = exact_match(student.eval(), tokenizer, curve_rows, ev.max_new_tokens)
    rows, _ = train_rows(paths, "opd", params.control)
    data = Dataset.from_list([{"prompt": [m for m in r["messages"] if m["role"] != "assistant"]} for r in rows])
    opt = make_optimizer(student, opd)
    sched = make_scheduler(opt, opd, steps)
    with tempfile.TemporaryDirectory(prefix="ars-opd-trl-") as out:
        args = DistillationConfig(
            output_dir=out,
            max_steps=steps,
            per_device_train_batch_size=opd.global_batch_size,
            gradient_accumulation_steps=1,
            max_completion_length=opd.max_new_tokens,
            temperature=opd.sample_temperature,
            top_p=1.0,
            top_k=0,
            beta=opd.beta,
            max_grad_norm=opd.max_grad_norm if opd.max_grad_norm is not None else 0.0,
            bf16=False,
            fp16=False,
            gradient_checkpointing=False,
            use_cpu=True,
            seed=seed,
            save_strategy="no",
            report_to=[],
            logging_steps=max(1, steps // 10),
            disable_tqdm=True,
        )
        trainer = DistillationTrainer(
            model=student,
            teacher_model=teacher,
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            optimizers=(opt, sched),
        )
        t0 = time.perf_counter()
        trainer.train()
        train_s = time.perf_counter() - t0
        model = trainer.model
    end, end_tasks = exact_match(model.eval(), tokenizer, curve_rows, ev.max_new_tokens)
    return {
        "seed": seed,
        "steps": steps,
        "start_exact_match": start,
        "end_exact_match": end,
        "change": end - start,
        "per_task_start": start_tasks,
        "per_task_end": end_tasks,
        "train_s": train_s,
        "trl": __import__("trl").__version__,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=None, help="default: opd.steps")
    p.add_argument("--init", type=Path, default=Path(INIT), help="the pinned SFT student")
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args(argv)
    try:
        import trl  # noqa: F401
    except ImportError:
        p.error("trl is not installed: `make trl` installs it into .venv (for benchmarks only)")
    params = load_params()
    if not (a.init / "config.json").exists():
        p.error(f"no pinned student at {a.init}: run studies/opd_ablation.sh (its base) first, in this workspace")
    curve_rows = read_jsonl(params.paths.completions("eval"))[: params.evaluate.curve_examples or None]
    curve_rows = [r for r in curve_rows if r.get("task") in synthetic.TASK_NAMES and r.get("reference") is not None]
    for seed in a.seeds:
        line = run_seed(seed, a.steps or params.opd.steps, params, a.init, curve_rows, a.threads)
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
