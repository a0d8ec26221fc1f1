"""The built-in models of the offline default: tiny causal LMs from config, and the teacher's training.

``build_causal_lm`` creates a Qwen3- or Llama-shaped model for the local tokenizer with a seeded
initialisation; saved beside a copy of the tokenizer it is a complete HF directory that
``from_pretrained`` and the bundled server load.

The offline default needs a teacher that is good at the tasks, so the ``models`` stage trains one from
scratch (``train_builtin_teacher``): a fresh, seeded stream of synthetic examples each step (no example
repeats by construction of the stream, though small task spaces such as two-digit addition recur), loss
on response tokens only, the shared optimiser setup (``ars_opd.lm.optim``) with the
``models.teacher_training`` params, fp32 on one process. Deterministic for a seed and a thread count.

This is deliberately a small single-process loop that builds the *default teacher*; the data-parallel
engine with exact loss normalisation and consistency statistics is what trains the student.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterator

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from ars_opd.config import ArchConfig, SyntheticConfig, TeacherTrainingConfig
from ars_opd.data import synthetic
from ars_opd.data.prompts import alpaca_messages, encode_completions, encode_prompts
from ars_opd.lm.batching import pad_right_with_labels
from ars_opd.lm.cross_entropy import causal_lm_token_loss_sum
from ars_opd.lm.generation import generate_texts
from ars_opd.lm.optim import clip_gradients, make_optimizer, make_scheduler


def build_causal_lm(arch: ArchConfig, tokenizer: PreTrainedTokenizerBase, seed: int) -> PreTrainedModel:
    """A randomly initialised causal LM of shape ``arch`` for ``tokenizer``'s vocabulary (seeded)."""
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_hidden_layers=arch.num_layers,
        num_attention_heads=arch.num_heads,
        num_key_value_heads=arch.num_kv_heads,
        max_position_embeddings=arch.max_position_embeddings,
        tie_word_embeddings=arch.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if arch.family == "qwen3":
        from transformers import Qwen3Config

        config = Qwen3Config(head_dim=arch.hidden_size // arch.num_heads, **common)
    elif arch.family == "llama":
        from transformers import LlamaConfig

        config = LlamaConfig(head_dim=arch.hidden_size // arch.num_heads, **common)
    else:  # config validation makes this unreachable from params
        raise ValueError(f"unknown architecture family {arch.family!r}")
    torch.manual_seed(seed)
    # eager attention: ~10% faster than SDPA at these tiny widths on CPU
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    return model


def save_builtin_model(directory, arch: ArchConfig, tokenizer: PreTrainedTokenizerBase, seed: int = 0):
    """``build_causal_lm(arch, tokenizer, seed)`` saved with ``tokenizer`` in ``directory``: a self-contained Hugging
    Face directory (what a server, vLLM included, or a stage loads). Returns ``directory``."""
    build_causal_lm(arch, tokenizer, seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def count_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


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
    opt = make_optimizer(model, cfg)
    sched = make_scheduler(opt, cfg, cfg.steps)
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    log, running = [], None
    bar = tqdm(range(cfg.steps), desc="train teacher", disable=not progress, mininterval=2.0)
    for step in bar:
        batch = next(batches)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss_sum, n = causal_lm_token_loss_sum(logits, batch["labels"])
        loss = loss_sum / n
        if not torch.isfinite(loss):
            raise FloatingPointError(
                f"teacher training loss is {loss.item()} at step {step}; lower models.teacher_training.lr"
            )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_gradients(params, cfg.max_grad_norm)
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
    max_new_tokens: int | None = None,
    batch_size: int = 128,
) -> dict:
    """Greedy exact-match accuracy on Alpaca rows with ``task``; overall and per task (on the long-horizon
    tasks, of the final answer: ``synthetic.is_correct_for``).

    The reference is recomputed from the instruction and input by ``synthetic.expected_answer``, an
    oracle independent of the stored ``output``. ``max_new_tokens`` (None: 16, or twice the longest reference
    with its EOS when that is more) leaves room past the longest reference, so an answer that runs on is
    judged whole rather than cut to a right-looking prefix.
    """
    if not rows:
        raise ValueError("exact_match needs at least one row")
    if max_new_tokens is None:
        longest = max(len(ids) for ids in encode_completions(tokenizer, [r["output"] for r in rows]))
        max_new_tokens = max(16, 2 * longest)
    answers = generate_texts(
        model,
        tokenizer,
        [alpaca_messages(r["instruction"], r["input"]) for r in rows],
        max_new_tokens=max_new_tokens,
        batch_size=batch_size,
    )
    per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r, a in zip(rows, answers):
        ok = synthetic.is_correct_for(r["task"], a, synthetic.expected_answer(r["task"], r["instruction"], r["input"]))
        per_task[r["task"]][0] += int(ok)
        per_task[r["task"]][1] += 1
    correct = sum(c for c, _ in per_task.values())
    return {
        "exact_match": correct / len(rows),
        "n": len(rows),
        "per_task": {t: c / n for t, (c, n) in sorted(per_task.items())},
    }
