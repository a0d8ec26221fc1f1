"""OPD's anchor on the teacher's text (``opd.anchor``): in every on-policy step, the teacher's cached completions of
the step's own prompts trained beside the student's rollouts, in the same forward.

The rows are the teacher_gen completions the SFT stage trained on (no new teacher cost), cut at
``max_new_tokens`` as GKD's teacher-text steps cut them. ``joint_hidden`` runs the rollout rows and the anchor rows
as one right-padded batch (one forward per backward, as DDP needs) and splits the result; ``anchor_loss`` is
``anchor_weight`` times their summed token losses (cross-entropy of the teacher's tokens, or the full-vocabulary
KL(teacher ‖ student) for ``forward_kl`` with a local teacher), over the rollouts' normaliser.
"""

from __future__ import annotations

import torch

from ars_opd.config import OPDConfig
from ars_opd.lm.batching import pad_right_with_labels, sequence_weights
from ars_opd.lm.cross_entropy import cross_entropy_terms, shifted_targets
from ars_opd.lm.divergences import divergence_terms
from ars_opd.lm.head import OutputHead, chunked_head_loss, last_hidden_states, select_rows
from ars_opd.lm.opd_objectives import TeacherLogits, recorded, weighted


def anchor_rows(prompts: list[list[int]], completions: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """A micro-batch's anchor rows: its prompts and the teacher's completions of them, right-padded: ids,
    attention, and the scored positions and their targets (``cross_entropy.shifted_targets``)."""
    b = pad_right_with_labels(prompts, completions, pad_id)
    mask, targets = shifted_targets(b["labels"])
    return {
        "anchor_input_ids": b["input_ids"],
        "anchor_attention_mask": b["attention_mask"],
        "anchor_mask": mask,
        "anchor_targets": targets,
    }


def joint_hidden(model: torch.nn.Module, t: dict, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The student's last hidden states of the rollout rows (B, T, H) and, from the same forward, its hidden rows at
    the anchor's scored positions (M_a, H): both sets right-padded to one width and run as one batch, then split."""
    ids, attn = t["input_ids"], t["attention_mask"]
    a_ids, a_attn = t["anchor_input_ids"], t["anchor_attention_mask"]
    width = max(ids.shape[1], a_ids.shape[1])

    def right(x: torch.Tensor, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    hidden = last_hidden_states(
        model,
        torch.cat([right(ids, pad_id), right(a_ids, pad_id)]),
        torch.cat([right(attn, 0), right(a_attn, 0)]),
    )
    B = ids.shape[0]
    return hidden[:B, : ids.shape[1]], select_rows(hidden[B:, : a_ids.shape[1]], t["anchor_mask"])


def anchor_loss(
    anchor_hidden: torch.Tensor, head: OutputHead, t: dict, cfg: OPDConfig, teacher=None
) -> tuple[torch.Tensor, tuple[float, float]]:
    """(anchor_weight × the anchor's summed token losses, with grad; the ``anchor_loss`` column's (sum, count) of the
    unweighted token losses). ``teacher``: the local teacher (a model and its vocabulary), for forward_kl."""
    targets = t["anchor_targets"]
    if cfg.anchor == "sft":
        terms = cross_entropy_terms(targets)
    else:
        with torch.no_grad():
            rows = select_rows(
                last_hidden_states(teacher.model, t["anchor_input_ids"], t["anchor_attention_mask"]), t["anchor_mask"]
            )
        logits = TeacherLogits(rows, OutputHead.of(teacher.model, teacher.vocab))
        terms = divergence_terms(logits.rows, beta=0.0, temperature=cfg.temperature)
    values = torch.empty(anchor_hidden.shape[0], dtype=torch.float32, device=anchor_hidden.device)
    w = torch.full_like(values, cfg.anchor_weight)
    if cfg.loss_normalisation == "sequence":  # each anchor row weighs anchor_weight, over its tokens
        w = w * sequence_weights(t["anchor_mask"])
    total = chunked_head_loss(anchor_hidden, head, weighted(recorded(terms, values), w), cfg.chunk_size)
    return total, (float(values.sum()), float(values.numel()))
