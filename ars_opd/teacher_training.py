"""Training the built-in teacher on the synthetic tasks, and exact-match evaluation.

The offline default needs a teacher that is good at the tasks, so the ``models`` stage trains one from
scratch: a fresh, seeded stream of synthetic examples each step (no example repeats by construction of
the stream, though small task spaces such as two-digit addition recur), loss on response tokens only,
AdamW with linear warmup and cosine decay, fp32 on one process. Deterministic for a seed and a thread
count.

This is deliberately a small single-process loop that builds the *default teacher*; the data-parallel
engine with exact loss normalisation and consistency statistics is what trains the student.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ars_opd import synthetic
from ars_opd.config import SyntheticConfig, TeacherTrainingConfig
from ars_opd.generation import generate_texts, pad_right_with_labels
from ars_opd.losses import causal_lm_token_loss_sum
from ars_opd.prompts import alpaca_messages, encode_completions, encode_prompts
from ars_opd.schedules import warmup_cosine


def task_spec(cfg: SyntheticConfig) -> synthetic.TaskSpec:
    return synthetic.TaskSpec(max_operand=cfg.max_operand, min_len=cfg.min_len, max_len=cfg.max_len)


def _batches(tokenizer, rows: Iterator[dict], batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """Right-padded batches in stream order.

    Deliberately not grouped by length: on the synthetic tasks length predicts the task, so length
    buckets make batches single-task and the alternating gradients stall the copy tasks (measured:
    reverse and uppercase at 0% after 1,000 steps with buckets, learned without).
    """
    while True:
        chunk = [next(rows) for _ in range(batch_size)]
        prompts = encode_prompts(tokenizer, [alpaca_messages(r["instruction"], r["input"]) for r in chunk])
        completions = encode_completions(tokenizer, [r["output"] for r in chunk])
        yield pad_right_with_labels(prompts, completions, tokenizer.pad_token_id)


def train_builtin_teacher(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    cfg: TeacherTrainingConfig,
    tasks: SyntheticConfig,
    seed: int,
    progress: bool = True,
) -> list[dict]:
    """Train ``model`` in place; returns a log row every 50 steps (step, loss, lr)."""
    torch.manual_seed(seed)
    batches = _batches(tokenizer, synthetic.stream(seed, tasks.tasks, task_spec(tasks)), cfg.batch_size)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr, betas=(0.9, 0.95),
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: warmup_cosine(s, cfg.steps, cfg.warmup_steps, cfg.min_lr_ratio))
    model.train()
    log, running = [], None
    bar = tqdm(range(cfg.steps), desc="train teacher", disable=not progress, mininterval=2.0)
    for step in bar:
        batch = next(batches)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_sum, n = causal_lm_token_loss_sum(logits, batch["labels"])
        loss = loss_sum / n
        if not torch.isfinite(loss):
            raise FloatingPointError(f"teacher training loss is {loss.item()} at step {step}; lower models.teacher_training.lr")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        value = loss.item()
        running = value if running is None else 0.98 * running + 0.02 * value
        bar.set_postfix(loss=f"{running:.3f}", refresh=False)
        if step % 50 == 0 or step == cfg.steps - 1:
            # no wall-clock time here: this log lies in data/models, which every later stage depends on,
            # and a time in it would change that directory's hash (and rerun everything) on each retrain
            log.append({"step": step, "loss": value, "lr": sched.get_last_lr()[0]})
    model.eval()
    return log


def exact_match(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    max_new_tokens: int = 16,
    batch_size: int = 128,
) -> dict:
    """Greedy exact-match accuracy on Alpaca rows with ``task``; overall and per task.

    The reference is recomputed from the instruction and input by ``synthetic.expected_answer``, an
    oracle independent of the stored ``output``.
    """
    if not rows:
        raise ValueError("exact_match needs at least one row")
    answers = generate_texts(model, tokenizer, [alpaca_messages(r["instruction"], r["input"]) for r in rows],
                             max_new_tokens=max_new_tokens, batch_size=batch_size)
    per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r, a in zip(rows, answers):
        ok = synthetic.is_correct(a, synthetic.expected_answer(r["task"], r["instruction"], r["input"]))
        per_task[r["task"]][0] += int(ok)
        per_task[r["task"]][1] += 1
    correct = sum(c for c, _ in per_task.values())
    return {
        "exact_match": correct / len(rows),
        "n": len(rows),
        "per_task": {t: c / n for t, (c, n) in sorted(per_task.items())},
    }
