"""Evaluate with several teachers (``teachers.named``): each held-out row measured against its own teacher.

``RowTeachers`` stands where the evaluate stage's one teacher stands in the per-token losses
(``ars_opd.evaluation.token_losses``): row i of the held-out data is scored against ``models[index[i]]``.
``teacher_logits`` is the one place those losses ask a teacher for its logits at a batch's scored positions: a
model gives its ``TeacherLogits`` as always; ``RowTeachers`` runs each teacher's forward on its own rows of the
batch and answers with ``RoutedLogits`` (``ars_opd.lm.routed_logits``), each position's logits from its row's
teacher's head, a chunk at a time. ``text_logits`` does the same for the teacher's hidden rows on its own
completions (the fixed-prefix reverse KL, ``TeacherTextRows``), computed once per row by its own teacher.

The teacher's own row of the table (``teacher_row``) is every teacher answering its own rows: each is scored on the
held-out rows routed to it by the stage's ``score_model``, and the parts are put together here, each figure weighted
by what it is a mean over (checkable rows for exact match, per task too; the teacher's completion tokens for the
NLL; rows for how its samples end), with the parts themselves kept under ``per_teacher``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows
from ars_opd.lm.opd_objectives import TeacherLogits
from ars_opd.lm.routed_logits import RoutedLogits


@dataclass
class RowTeachers:
    """Several teachers over the held-out rows: row i's is ``models[index[i]]`` (``names[index[i]]``)."""

    names: tuple[str, ...]
    models: list[torch.nn.Module]
    index: list[int]

    def rows_of(self, start: int, n: int) -> torch.Tensor:
        """(n,) the teachers of rows start..start+n-1."""
        return torch.tensor(self.index[start : start + n], dtype=torch.long)


def _hidden(model, batch: dict, mask: torch.Tensor, device: torch.device, rows=None) -> torch.Tensor:
    ids, attn = batch["input_ids"], batch["attention_mask"]
    if rows is not None:
        ids, attn, mask = ids[rows], attn[rows], mask[rows]
    hidden = last_hidden_states(model, ids.to(device), attn.to(device))
    return select_rows(hidden, mask.to(device))


def teacher_logits(teacher, batch: dict, mask: torch.Tensor, device: torch.device, vocab: int, start: int):
    """The teacher's logits at ``mask``'s positions of ``batch`` (rows ``start``.. of the held-out data), formed a
    chunk at a time: ``TeacherLogits`` of one model, or ``RoutedLogits`` of each row's own (``RowTeachers``)."""
    if not isinstance(teacher, RowTeachers):
        return TeacherLogits(_hidden(teacher, batch, mask, device), OutputHead.of(teacher, vocab))
    owner_of_row = teacher.rows_of(start, mask.shape[0])
    owner = owner_of_row[mask.nonzero()[:, 0]]  # (M,)
    parts = []
    for k, model in enumerate(teacher.models):
        rows = owner_of_row == k
        if not bool(rows.any()):
            continue
        logits = TeacherLogits(_hidden(model, batch, mask, device, rows), OutputHead.of(model, vocab))
        parts.append((logits, (owner == k).nonzero().squeeze(-1).to(device)))
    return RoutedLogits(parts, int(owner.numel()), vocab, device)


def text_rows(teacher, batch: dict, mask: torch.Tensor, device: torch.device, start: int) -> list[torch.Tensor]:
    """The teacher's hidden rows at each row's ``mask`` positions, one (n_i, H) tensor per row of ``batch`` (rows
    ``start``.. of the held-out data), each row's from its own teacher."""
    if not isinstance(teacher, RowTeachers):
        return list(_hidden(teacher, batch, mask, device).split(mask.sum(1).tolist()))
    owner_of_row = teacher.rows_of(start, mask.shape[0])
    out: list[torch.Tensor | None] = [None] * mask.shape[0]
    for k, model in enumerate(teacher.models):
        rows = (owner_of_row == k).nonzero().squeeze(-1)
        if not rows.numel():
            continue
        hidden = _hidden(model, batch, mask, device, rows).split(mask[rows].sum(1).tolist())
        for r, h in zip(rows.tolist(), hidden):
            out[r] = h
    return out


def text_logits(teacher, rows: list[torch.Tensor], start: int, device: torch.device, vocab: int):
    """The teacher's logits at its hidden ``rows`` of a batch (rows ``start``..), a chunk at a time."""
    if not isinstance(teacher, RowTeachers):
        return TeacherLogits(torch.cat(rows).to(device), OutputHead.of(teacher, vocab))
    owner_of_row = teacher.rows_of(start, len(rows))
    owner = torch.cat([torch.full((r.shape[0],), int(k)) for r, k in zip(rows, owner_of_row)])
    parts = []
    for k, model in enumerate(teacher.models):
        mine = [r for r, o in zip(rows, owner_of_row.tolist()) if o == k]
        if not mine:
            continue
        parts.append(
            (
                TeacherLogits(torch.cat(mine).to(device), OutputHead.of(model, vocab)),
                (owner == k).nonzero().squeeze(-1).to(device),
            )
        )
    return RoutedLogits(parts, int(owner.numel()), vocab, device)


def per_teacher(
    labels: list[str], rows: list[dict], checkable: list[bool], texts: list[str], is_correct, losses
) -> dict:
    """A scored model's figures per teacher, over each teacher's rows: n, exact match (checkable rows), and each
    per-token loss of ``losses`` ({name: TokenLosses}) as the token-weighted mean over the teacher's rows."""
    out: dict[str, dict] = {}
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # rows, checkable, right
    for label, row, ok, text in zip(labels, rows, checkable, texts):
        c = counts[label]
        c[0] += 1
        if ok:
            c[1] += 1
            c[2] += int(is_correct(row, text))
    for name in sorted(counts):
        n, checked, right = counts[name]
        out[name] = {"examples": n, "exact_match": right / checked if checked else None}
    for key, loss in losses.items():
        if loss is None:
            continue
        for name, value in loss.per_task(labels).items():
            out[name][key] = value
    return out


def teacher_row(parts: dict[str, tuple[dict, list[str], list[int]]], data, n_rows: int) -> tuple[dict, list[str]]:
    """The teacher's row of the table from each teacher scored on its own rows: ``parts`` {name: (its metrics, its
    greedy answers, the held-out indices of its rows)}; ``data`` the whole held-out data (``HeldOut``)."""
    texts: list[str] = [""] * n_rows
    for _, answers, indices in parts.values():
        for i, t in zip(indices, answers):
            texts[i] = t
    m: dict = {"reverse_kl": 0.0, "reverse_kl_per_sequence": 0.0, "reverse_kl_kind": "exact"}
    m["reverse_kl_fixed_prefix"] = m["reverse_kl_first_sentence"] = 0.0
    weights = {
        name: {
            "rows": len(indices),
            "checkable": sum(data.checkable[i] for i in indices),
            "tokens": sum(len(data.completions[i]) for i in indices),
        }
        for name, (_, _, indices) in parts.items()
    }

    def mean(key: str, weight: str) -> float | None:
        pairs = [(p[0].get(key), weights[n][weight]) for n, p in parts.items() if p[0].get(key) is not None]
        total = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / total if total else None

    per_task_weights: dict[str, dict[str, dict[str, int]]] = {}
    for name, (_, _, indices) in parts.items():
        for kind in ("checkable", "tokens"):
            for i in indices:
                task = data.rows[i].get("task")
                if task is None or (kind == "checkable" and not data.checkable[i]):
                    continue
                w = per_task_weights.setdefault(kind, {}).setdefault(name, defaultdict(int))
                w[task] += 1 if kind == "checkable" else len(data.completions[i])

    def mean_per_task(key: str, kind: str) -> dict:
        acc: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for name, (pm, _, _) in parts.items():
            for task, v in (pm.get(key) or {}).items():
                w = per_task_weights.get(kind, {}).get(name, {}).get(task, 0)
                if v is not None and w:
                    acc[task][0] += v * w
                    acc[task][1] += w
        return {t: s / w for t, (s, w) in sorted(acc.items())}

    m["exact_match"] = mean("exact_match", "checkable")
    if m["exact_match"] is not None:
        m["exact_match_per_task"] = mean_per_task("exact_match_per_task", "checkable")
    m["exact_match_sampled"] = mean("exact_match_sampled", "checkable")
    m["teacher_nll"] = mean("teacher_nll", "tokens")
    m["teacher_nll_per_task"] = mean_per_task("teacher_nll_per_task", "tokens")
    m["reverse_kl_per_task"] = {t: 0.0 for t in sorted({r.get("task") for r in data.rows} - {None})}
    m["own_eos_rate"] = mean("own_eos_rate", "rows")
    m["own_length"] = mean("own_length", "rows")
    m["sampled_draws"] = next(iter(parts.values()))[0].get("sampled_draws")
    m["per_teacher"] = {name: p[0] for name, p in parts.items()}
    return m, texts
