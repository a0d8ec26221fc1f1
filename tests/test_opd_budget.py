"""OPD's sampling FLOPs count what generation computed, against a brute-force count of the student's forwards.

A batch of rollouts runs every row until its last row ends (or ``max_new_tokens``), on left-padded prompts:
rows that ended early and the padding are computed all the same. The budget charges 2·P_s per token position
the student's forward computed while sampling. Two independent oracles of that count:

- a forward pre-hook of the test's own on the student, adding up the token positions of every forward made
  while ``OPDTask.micro_batches`` runs (only the rollouts call the student there);
- the closed form of each rollout path, from the prompts and the rollouts alone: one prefill of B rows of
  the widest prompt W, then one position per row for each decode step: T − 1 steps for ``generate`` (T the
  longest rollout, each row cut at its first EOS), and for the static loop, which checks for the end every
  ``SYNC_EVERY`` steps, T rounded up to that multiple (at most ``max_new_tokens``) less one.

The former budget (each row's own prompt and its cut completion) is smaller whenever rows differ in length.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from ars_opd.config import OPDConfig
from ars_opd.lm.decoding import SYNC_EVERY
from ars_opd.lm.generation import eos_token_ids
from ars_opd.training.batch_plan import BatchGeometry
from ars_opd.training.budget import matmul_parameters
from ars_opd.training.distributed import WorkerContext
from ars_opd.training.opd.data import OPDData
from ars_opd.training.opd.task import ModelSizes, OPDTask, RolloutSetup
from ars_opd.training.opd.teachers import LocalTeacher
from ars_opd.training.worker import WorkerSetup
from tiny_models import tiny_llama

PAD, EOS, VOCAB = 0, 2, 40
ENDS = (2, 3, 4, 5, 6, 7)  # the model's generation_config EOS ids (the tokenizer names 2 alone)


class _Tok:
    pad_token_id, eos_token_id = PAD, EOS


def _model(seed: int):
    model = tiny_llama(VOCAB, seed, EOS, PAD, attn_implementation=None)
    # six of the 40 ids end a completion: its near-uniform rows end at different steps, most before max_new
    model.generation_config.eos_token_id = list(ENDS)
    return model


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_sampling_flops_count_every_position_the_student_computed(cache):
    student, teacher = _model(seed=1), _model(seed=2)
    rng = random.Random(0)
    prompts = [[rng.randrange(len(ENDS) + 2, VOCAB) for _ in range(rng.randint(2, 11))] for _ in range(8)]
    max_new = 40
    cfg = OPDConfig(
        global_batch_size=8, micro_batch_size=4, max_new_tokens=max_new, rollout_cache=cache, precision="fp32"
    )
    p_s, p_t = matmul_parameters(student), matmul_parameters(teacher)
    ctx = WorkerContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    task = OPDTask(
        OPDData(prompts, [[EOS]] * len(prompts)),
        LocalTeacher(teacher.eval(), VOCAB),
        cfg,
        WorkerSetup(ctx, _Tok, BatchGeometry.check(8, 1, 4, "opd"), sampler_seed=3, stage_seed=4, fault=None),
        sizes=ModelSizes(p_s, p_t),
        rollouts=RolloutSetup(eos_ids=eos_token_ids(student, _Tok)),  # as prepare_opd passes them
    )
    seen = []

    def count(_module, _args, kwargs):
        seen.append(kwargs["input_ids"].numel())

    handle = student.register_forward_pre_hook(count, with_kwargs=True)
    try:
        torch.manual_seed(5)
        batches = task.micro_batches(0, student)
    finally:
        handle.remove()
    lengths = torch.cat([b.tensors["loss_mask"].sum(1) for b in batches])  # each row's kept completion
    B, W, T = len(prompts), max(len(p) for p in prompts), int(lengths.max())
    assert int(lengths.min()) < T < max_new and T % SYNC_EVERY  # rows end at different steps, all before max_new
    steps = T if cache == "dynamic" else min(max_new, math.ceil(T / SYNC_EVERY) * SYNC_EVERY)
    closed_form = B * W + B * (steps - 1)
    assert sum(seen) == closed_form  # the two oracles agree
    trained = sum(b.n_real_tokens for b in batches)
    assert sum(b.flops for b in batches) == (6 * p_s + 2 * p_t) * trained + 2 * p_s * closed_form
    # what the former budget charged is less: each row's own prompt and its cut completion only
    assert sum(len(p) for p in prompts) + int(lengths.sum()) < closed_form
    # the kept tokens are still what tokens_generated counts
    assert sum(b.generated_tokens for b in batches) == int(lengths.sum())
