"""Teacher logits at a batch's scored positions when each row has its own teacher (several teachers, one student).

A loss over the full vocabulary walks the M scored positions a chunk at a time and asks the teacher for that
chunk's logits (``ars_opd.lm.opd_objectives.TeacherLogits.rows``), so no (M × V) tensor is ever kept. With several
teachers each position's logits come from its row's teacher. ``RoutedLogits`` answers the same ``rows(start, end)``
from one ``TeacherLogits`` per teacher over that teacher's own positions: the positions are row-major and a teacher
owns whole rows, so a teacher's positions inside any chunk are a contiguous run of its own (local) positions, and
each teacher's head runs on exactly its positions, chunk by chunk. It records log p_T(target) at τ = 1 of every
position as a chunk passes (``target_logprobs``), as ``TeacherLogits`` does. Used by OPD
(``ars_opd.training.teacher_route``) and by evaluate (``ars_opd.evaluation.row_teachers``).
"""

from __future__ import annotations

import torch


class RoutedLogits:
    """The M scored positions' teacher logits, each position's from its own teacher, formed a chunk at a time.

    ``parts``: for each teacher with rows here, (its ``TeacherLogits`` over its own positions, the global indices
    of those positions (ascending)). ``rows(start, end)`` forms the chunk's logits from each teacher's head on its
    own positions in the chunk (a contiguous run of its local positions) and records log p_T(target) at τ = 1 of
    those positions into ``target_logprobs``, as ``TeacherLogits`` does."""

    def __init__(self, parts: list[tuple[object, torch.Tensor]], m: int, vocab: int, device: torch.device):
        self.parts, self.vocab = parts, vocab
        self.target_logprobs = torch.full((m,), float("nan"), device=device)
        # for each part, how many of its positions lie before each global index (to find its run in a chunk)
        self._starts = [
            torch.searchsorted(positions, torch.arange(m + 1, device=positions.device)) for _, positions in parts
        ]

    def rows(self, start: int, end: int) -> torch.Tensor:
        z = None
        for (logits, positions), before in zip(self.parts, self._starts):
            a, b = int(before[start]), int(before[end])
            if a == b:
                continue
            chunk = logits.rows(a, b)  # (b - a, V) fp32
            if z is None:
                z = torch.empty((end - start, chunk.shape[-1]), dtype=chunk.dtype, device=chunk.device)
            where = positions[a:b] - start
            z[where] = chunk
            self.target_logprobs[positions[a:b]] = logits.target_logprobs[a:b]
        return z
