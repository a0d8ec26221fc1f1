"""What a training run cost: steps, tokens, generated tokens and an estimate of FLOPs, from scratch.

Methods are compared at equal budget, not at equal stage names: an OPD step samples rollouts and runs the
teacher, an SFT step does neither. Every micro-batch carries its FLOPs estimate (the task fills it in):

- training the student: 6·P_s FLOPs per token it processes (forward 2, backward 4), prompt included;
- scoring with the teacher: 2·P_t per token of the scored sequences (a forward pass);
- sampling rollouts: 2·P_s per token position the student's forward computes while generating, as
  counted where it happens (``ars_opd.lm.generation.GenerationCost``): the left-padded prompt batch's
  prefill, padding included, and one position per row for every decode step, also for rows that already
  ended, since a batch steps until its last row ends or ``max_new_tokens`` (the KV cache makes each step
  one token's forward per row).

P is the number of parameters used in matrix products per token (``matmul_parameters``: every parameter,
less an untied input embedding, which is a lookup). A student trained through a LoRA adapter
(``ars_opd.models.adapters``) counts P = P_base + P_adapter, so training costs 6·(P_base + P_adapter) per
token: the forward and backward through the frozen base as if it were trained, plus the adapter's own
(r·(d_in + d_out) per adapted layer); a module trained whole beside the adapter (``modules_to_save``) counts
once, as its trained copy. The frozen base needs no weight gradients, so the true cost is nearer
4·P_base + 6·P_adapter; the 6·P form keeps full and adapter runs on one axis, an overestimate of at most
a third for the adapter runs. Attention's own O(T²) term is left out: at the short
sequences of the pipeline it is a few percent; the estimate is for comparing methods, not for MFU.

``budget.json`` in a model directory (and in each learning-curve snapshot) holds the cumulative budget
*from scratch*: a run started from another model's weights adds its own costs to that model's budget, so
the steps and FLOPs axes of a continued run line up with those of the run it continued. A run keeps that
total as it trains (``BudgetTotals``): the starting model's budget plus every logged step's costs, a pure
function of the step log, so a resumed run rebuilds it from the checkpoint's log.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

BUDGET_FILE = "budget.json"
SNAPSHOTS = "snapshots"  # learning-curve snapshots (step_N/, each with its budget.json) inside a model directory
# teacher_tokens: tokens the teacher generated for the text the lineage trained on, each row once
# (ars_opd.training.data_cost); 2·P_teacher FLOPs each when the comparison counts the teacher's data cost
FIELDS = ("steps", "flops", "tokens_trained", "tokens_processed", "tokens_generated", "teacher_tokens")


def matmul_parameters(model: torch.nn.Module) -> int:
    """Parameters used in a matrix product per token: all distinct ones, less an untied input embedding."""
    # a module trained whole beside an adapter (peft's modules_to_save) computes with its trained copy; the
    # frozen original beside it (".original_module.") is in no product
    unique = {id(p): p for n, p in model.named_parameters() if ".original_module." not in n}
    total = sum(p.numel() for p in unique.values())
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if get_in is not None and get_out is not None and get_in() is not None and get_out() is not None:
        emb, head = get_in().weight, get_out().weight
        if emb is not head:
            total -= emb.numel()
    return total


def read_budget(model_dir: str | Path) -> dict:
    """The cumulative budget stored with a model (zeros for a model with none, e.g. a fresh base model)."""
    path = Path(model_dir) / BUDGET_FILE
    if not path.exists():
        return {k: 0 for k in FIELDS}
    data = json.loads(path.read_text())
    return {k: data.get(k, 0) for k in FIELDS}


def write_budget(model_dir: str | Path, budget: dict, trainable_parameters: int | None = None) -> None:
    """``budget.json``: the cumulative budget, and the trainable parameter count of the run that wrote it (all
    of them in full fine-tuning, the adapter's with LoRA)."""
    Path(model_dir).mkdir(parents=True, exist_ok=True)
    data = {k: budget[k] for k in FIELDS}
    if trainable_parameters is not None:
        data["trainable_parameters"] = trainable_parameters
    (Path(model_dir) / BUDGET_FILE).write_text(json.dumps(data, sort_keys=True) + "\n")


class BudgetTotals:
    """The run's cumulative budget from scratch: the starting model's budget plus every logged step's costs."""

    def __init__(self, start: dict):
        self.totals = {k: start.get(k, 0) for k in FIELDS}

    @classmethod
    def from_log(cls, start: dict, rows: list[dict]) -> BudgetTotals:
        """The totals after the logged steps ``rows`` (a resumed run's history) of a run from ``start``."""
        totals = cls(start)
        for row in rows:
            totals.update({k: row.get(f"budget/{k}", 0) for k in FIELDS[1:]})
        return totals

    def update(self, step_budget: dict) -> dict:
        self.totals["steps"] += 1
        for k in FIELDS[1:]:
            self.totals[k] += step_budget.get(k, 0)
        return {f"budget/{k}_total": v for k, v in self.totals.items()}
