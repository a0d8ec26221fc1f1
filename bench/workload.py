"""The training benchmarks' shared workload: students built from a preset, a random-token SFT task, a run.

``consistency_overhead.py``, ``scale.py`` and ``sft_throughput.py`` measure the engine on the same kind of
student and data, so they build them here, once:

- ``PRESETS`` and ``preset_model``: a Llama- or Qwen3-shaped causal LM built from its config (tied head,
  fp32 weights, seed 0; SDPA attention on CUDA, eager on CPU);
- ``random_sft_task``: ``SFTTask`` over random token ids (half the sequence prompt, half completion, drawn
  from ``random.Random(rank)``), one micro-batch per worker per step;
- ``BenchRun``: one copy of the student as the engine trains it (wrapped for the strategy, with or
  without the consistency monitor, AdamW and its schedule), stepped by the engine's own ``Trainer.step``.

The scripts import it by its bare name, as they import one another (``python bench/<script>.py`` puts
bench/ on the path); ``bench/gpu.py`` does not, since it needs torch and transformers only.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import NamedTuple

import torch

from ars_opd.config import ParallelConfig, SFTConfig
from ars_opd.lm.optim import make_optimizer, make_scheduler
from ars_opd.training.batch_plan import BatchGeometry
from ars_opd.training.checkpoint import TrainerState
from ars_opd.training.consistency import ConsistencyHook
from ars_opd.training.distributed import WorkerContext
from ars_opd.training.loop import Trainer
from ars_opd.training.sft import EncodedData, SFTTask
from ars_opd.training.sharding import ShardedConsistencyHook
from ars_opd.training.step_log import StepResult
from ars_opd.training.worker import WorkerSetup
from ars_opd.training.wrapping import unwrapped, wrap_model

PRESETS = {
    "tiny": dict(  # tests: seconds
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        family="llama",
    ),
    "cpu-small": dict(  # ~5M parameters
        vocab_size=8192,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        family="llama",
    ),
    "cpu-6m": dict(  # 7.3M parameters
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=64,
        family="llama",
    ),
    "cpu-50m": dict(  # 48.5M parameters
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=10,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=64,
        family="llama",
    ),
    "qwen3-0.6b": dict(
        vocab_size=151936,
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        family="qwen3",
    ),
}


def preset_model(preset: str, device: torch.device = torch.device("cpu"), **config) -> torch.nn.Module:
    """The preset's student on ``device``, initialised from seed 0; ``config``: more config fields."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    spec = dict(PRESETS[preset])
    cls = Qwen3Config if spec.pop("family") == "qwen3" else LlamaConfig
    torch.manual_seed(0)
    attn = "sdpa" if device.type == "cuda" else "eager"
    return AutoModelForCausalLM.from_config(
        cls(tie_word_embeddings=True, **config, **spec), dtype=torch.float32, attn_implementation=attn
    ).to(device)


def random_sft_task(
    ctx: WorkerContext, vocab: int, steps: int, micro: int, seq: int, **cfg
) -> tuple[SFTConfig, SFTTask]:
    """(config, task) of ``steps`` steps of ``micro`` random sequences of ``seq`` tokens per worker;
    ``cfg``: more ``SFTConfig`` fields (precision, clipping)."""
    rng = random.Random(ctx.rank)
    n = micro * steps
    data = EncodedData(
        [[rng.randrange(10, vocab) for _ in range(seq // 2)] for _ in range(n)],
        [[rng.randrange(10, vocab) for _ in range(seq // 2)] for _ in range(n)],
        {},
    )
    config = SFTConfig(
        steps=steps,
        warmup_steps=0,
        global_batch_size=micro * ctx.world_size,
        micro_batch_size=micro,
        max_seq_len=seq,
        **cfg,
    )
    geometry = BatchGeometry.check(config.global_batch_size, ctx.world_size, config.micro_batch_size, "bench")
    return config, SFTTask(
        data,
        config,
        WorkerSetup(ctx, SimpleNamespace(pad_token_id=0), geometry, sampler_seed=0, stage_seed=0, fault=None),
    )


class BenchRun(NamedTuple):
    """One copy of the student as the engine trains it."""

    wrapped: torch.nn.Module  # DDP, or the student itself sharded in place (fsdp)
    hook: ConsistencyHook | ShardedConsistencyHook | None  # the consistency monitor, if on
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    state: TrainerState

    @classmethod
    def start(
        cls, model: torch.nn.Module, ctx: WorkerContext, cfg: SFTConfig, ddp_cfg: ParallelConfig, monitor: bool, **hook
    ) -> BenchRun:
        """Wrap ``model`` for ``ddp_cfg.strategy``, attach the monitor if ``monitor`` (``hook``: its options)."""
        wrapped = wrap_model(model, ctx, ddp_cfg, cfg)
        monitor_hook = None
        if monitor:
            sharded = ddp_cfg.strategy == "fsdp"
            monitor_hook = (ShardedConsistencyHook if sharded else ConsistencyHook)(ctx.world_size, **hook)
            monitor_hook.attach(wrapped)
        opt = make_optimizer(unwrapped(wrapped), cfg)
        return cls(wrapped, monitor_hook, opt, make_scheduler(opt, cfg, cfg.steps), TrainerState())

    @property
    def model(self) -> torch.nn.Module:
        return unwrapped(self.wrapped)

    def step(self, task: SFTTask, ctx: WorkerContext, cfg: SFTConfig, drift_every: int = 0) -> StepResult:
        """One engine step (``Trainer.step``), the drift check every ``drift_every`` steps (0: never)."""
        trainer = Trainer(
            ctx=ctx,
            model=self.wrapped,
            task=task,
            cfg=cfg,
            opt=self.opt,
            sched=self.sched,
            state=self.state,
            monitor=self.hook,
            drift_every=drift_every,
        )
        result = trainer.step()
        self.state.step += 1
        return result
