"""Micro workspaces with several teachers (``teachers.named``), for the several-teacher tests.

Two built-in specialists trained on halves of the synthetic tasks (``arith``: add, sort_digits, length; ``words``:
reverse, uppercase) and ``main``, the models stage's own teacher, routed by task. A few dozen training steps: the
tests need teachers that differ (their distributions do from the first step, by their seeds), not good ones.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch

from micro import teacher_rows, write_micro_params
from tolerances import forward_bound, loss_bound, sum_bound

REPO = Path(__file__).resolve().parents[1]
ARITH, WORDS = ("add", "sort_digits", "length"), ("reverse", "uppercase")
ROUTE = {**{t: "arith" for t in ARITH}, **{t: "words" for t in WORDS}}
SPECIALISTS = [
    {"name": "arith", "source": "builtin", "tasks": list(ARITH)},
    {"name": "words", "source": "builtin", "tasks": list(WORDS)},
]
TEACHERS = {"named": [*SPECIALISTS, {"name": "main", "source": "teacher"}], "route": ROUTE}
QUICK_TEACHERS = {"teacher_training": {"steps": 20}}


def several_teachers_workspace(
    root: Path, teachers: dict = TEACHERS, opd: dict | None = None, workers: int = 2, extra: dict | None = None
) -> None:
    """``root`` ready for the opd stage: params (micro, these ``teachers`` and ``opd`` overrides), the models stage's
    output (its own teacher and the named ones), 64 teacher training rows (each carrying its routed teacher), and
    the base student standing in as the SFT student."""
    from ars_opd.artifacts import write_jsonl
    from ars_opd.config import BaseConfig, load_params
    from ars_opd.models.loading import load_model
    from ars_opd.models.prepare import prepare_models
    from ars_opd.models.teachers import ROUTE_COLUMN, Route

    root.mkdir(parents=True, exist_ok=True)
    over = {
        "teachers": teachers,
        "models": QUICK_TEACHERS,
        "opd": opd or {},
        "ddp": {"workers": workers, "threads_per_worker": 1},
        **(extra or {}),
    }
    write_micro_params(REPO, root / "params.yaml", over)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        p = load_params("params.yaml")
        prepare_models(
            BaseConfig(threads=1),
            p.models,
            p.synthetic,
            p.paths.models_dir,
            p.paths.models_metrics,
            progress=False,
            teachers=p.teachers,
        )
        rows = teacher_rows(64, seed=5)
        if p.teachers.active:  # as teacher_gen writes them: each row says which teacher answered it
            for row, name in zip(rows, Route(p.teachers).assign(rows, "rows")):
                row[ROUTE_COLUMN] = name
        Path(p.paths.teacher_dir).mkdir(parents=True, exist_ok=True)
        write_jsonl(Path(p.paths.teacher_dir) / "train.jsonl", rows)
        load_model(p.paths.models_dir, "student").save_pretrained(Path(p.paths.sft_model))
    finally:
        os.chdir(cwd)


def exact_row_losses(student, teacher, prompts, completions, kind: str, beta: float, tokenizer, width: int):
    """Float64 oracles of each row's summed loss against ``teacher`` (each row alone, no padding), with the bound of
    one fp32 computation of it at any batch shape: the logits within ``forward_bound`` of the models' float64 ones,
    carried through the loss by ``loss_bound``, plus the row's sum."""
    from ars_opd.lm.batching import build_rollout_batch

    s64, t64 = copy.deepcopy(student).double(), copy.deepcopy(teacher).double()
    vocab = len(tokenizer)
    values, bounds = [], []
    for p, c in zip(prompts, completions):
        b = build_rollout_batch([p], [c], tokenizer.pad_token_id, tokenizer.eos_token_id)
        mask = b["loss_mask"][0]
        with torch.no_grad():
            zs = s64(input_ids=b["input_ids"]).logits[0, :, :vocab][mask]
            zt = t64(input_ids=b["input_ids"]).logits[0, :, :vocab][mask]
        fs = forward_bound(student.config, width, zs.abs().max().item())
        ft = forward_bound(teacher.config, width, zt.abs().max().item())
        value, bound = loss_bound(
            kind,
            zs,
            torch.full_like(zs, fs),
            zt,
            torch.full_like(zt, ft),
            targets=b["targets"][0][mask],
            beta=beta,
            rows=True,
        )
        values.append(float(value.sum()))
        bounds.append(float(bound.sum() + sum_bound(value.numel(), value.abs().sum())))
    return values, bounds
