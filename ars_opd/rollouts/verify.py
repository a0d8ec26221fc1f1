"""The version probe's parts: the probe sequences, the trainer's side of the probe, the derived fp32 bound.

After the trainer publishes version v and the engine reports it loaded, the engine scores fixed probe
sequences (their ``prompt_logprobs``) and the trainer runs the same sequences through the weights it just
published; the check that compares the two, with its calibrated tolerance, its verdicts and what it keeps from
sync to sync, is ``ars_opd.rollouts.version_check``. This catches an engine that answers "loaded" and keeps
serving other weights (vLLM issue #32718; on vLLM CPU a stock ``reload_weights`` leaves a tied output head
stale, 4.8e-6 from "new embedding, old head"), or a load that failed part-way.

The trainer's side (``trainer_logprobs`` on ``published_model``) is a forward of exactly the fp32 weights that
were published, in eval mode, normalised over the ids the engine normalises over; the probe's ids are the
tokenizer's (``probe_ids``).

The bound (``probe_bound``) is the fp32 rounding model of the tests (``tests/tolerances.py``, repeated here
because the library cannot import the tests): two forwards of one decoder, each within
Σ_k γ_{n_k}·max|logit| of the exact log-probabilities over the reduction lengths n_k of the layers, the head
and the log-softmax; worst-case n, not the typical √n, as the margin for the model's assumption that the
layers pass errors on without gain. It is a worst case, so it grows with the model (0.0017–0.0057 on the
built-in students, 0.37–0.51 on an 81M-parameter one): the check holds later syncs to a tolerance calibrated
within it. An engine in another precision (bf16) is not covered by this model: such a run must state its
tolerance (``opd.engine.probe_tolerance``). ``check_probe`` is the fixed-bound check alone (the benches use it).
"""

from __future__ import annotations

import contextlib
import math
import random
from dataclasses import dataclass
from typing import Iterator

import torch

from ars_opd.rollouts.engine_api import EngineError

U32 = 2.0**-24  # fp32 unit roundoff


class StaleEngineError(EngineError):
    """The engine's log-probabilities on the probe are not those of the version the trainer published. A refusal,
    not a crash: its message names the engine, the version and what to check, and the stage prints it alone."""


def _gamma(n: int, u: float) -> float:
    if n * u >= 1:
        raise ValueError(f"{n} roundings at u = {u} leave no bound")
    return n * u / (1 - n * u)


def decoder_lengths(config, seq_len: int) -> list[int]:
    """Reduction lengths of one forward through a Llama/Qwen3-layout decoder (per layer: the norms, the q/k/v,
    attention and output products, the MLP; about ten elementwise operations), then the final norm."""
    h = config.hidden_size
    d = getattr(config, "head_dim", None) or h // config.num_attention_heads
    per_layer = [h, h, d, seq_len, seq_len, config.num_attention_heads * d, h, h, config.intermediate_size, 10]
    return per_layer * config.num_hidden_layers + [h]


def probe_bound(config, seq_len: int, max_abs_logit: float, vocab: int) -> float:
    """Bound on |engine − trainer| for any log-probability of the probe: twice one fp32 forward's bound."""
    lengths = decoder_lengths(config, seq_len) + [config.hidden_size]
    lengths.append(vocab + 7 * max_abs_logit + 4 * math.log(vocab) + 4)  # the log-softmax
    one = sum(_gamma(math.ceil(n), U32) for n in lengths) * max(max_abs_logit, 1.0)
    return 2 * one


def probe_ids(vocab: int, length: int, seed: int) -> list[int]:
    """A fixed sequence of token ids (the same for every sync of a run): seeded, any of the ids 0..vocab-1. The
    caller passes the tokenizer's ids, not the output rows: an engine may refuse an id beyond its tokenizer (the
    bundled server does, 400), and rows beyond it are padding no text holds."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode for the block, each module's own mode restored after. The engine computes the
    published weights without dropout, so the trainer's side of the probe must too: a LoRA adapter's dropout
    (or any other) in train mode moved the probe by 0.058 against a bound of 1.7e-4."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@torch.no_grad()
def trainer_logprobs(
    model: torch.nn.Module, ids: list[int], device: torch.device, vocab: int | None = None
) -> tuple[torch.Tensor, float]:
    """log p(ids[t] | ids[:t]) for t ≥ 1 under ``model`` in fp32 and in eval mode (``eval_mode``), as float64
    (len − 1,), and max |logit|; normalised over the ids 0..vocab-1, those the engine normalises over (the
    bundled server: its tokenizer's; vLLM: every output row, padding included), None: every output row."""
    from ars_opd.lm.head import OutputHead, last_hidden_states

    x = torch.tensor([ids], dtype=torch.long, device=device)
    with eval_mode(model):
        hidden = last_hidden_states(model, x, torch.ones_like(x))[0, :-1].float()  # (T-1, H)
    head = OutputHead.of(model, vocab)
    logits = head.logits(hidden).float()
    logp = torch.log_softmax(logits, dim=-1).gather(-1, x[0, 1:, None]).squeeze(-1)
    return logp.double().cpu(), float(logits.abs().max())


def published_model(model: torch.nn.Module, state: dict[str, torch.Tensor], cached: torch.nn.Module | None):
    """The module whose forward is the trainer's side of the probe, on rank 0, for the weights ``state`` it just
    published: ``model`` itself where its forward computes exactly those weights in fp32 (a plain or DDP
    student; a LoRA one, merged for the engine, in eval mode), else a plain fp32 copy of the student holding
    ``state``'s tensors (``cached``, when given, reused: its parameters are replaced). The copy is for a
    sharded (FSDP2) student, whose forward runs in FSDP's parameter dtype (bf16 under mixed precision: 3.5e-3
    from the fp32 engine against a bound of 2.0e-4, refused as a stale engine at version 0) and is a collective;
    the state is on the CPU (gathered there), so the copy adds no accelerator memory."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule):
        return model
    plain = cached
    if plain is None:
        cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # FSDP2 subclasses the model
        plain = cls(model.config).to(torch.float32).eval()
    plain.load_state_dict(state, strict=False, assign=True)
    if getattr(plain.config.get_text_config(), "tie_word_embeddings", False):
        plain.tie_weights()
    return plain


@dataclass(frozen=True)
class ProbeResult:
    """One sync's check: the engine's distance from the published version, the bound, and how far the update
    moved the probe (None at the first sync)."""

    version: int
    max_abs_diff: float
    mean_abs_diff: float
    bound: float
    separation: float | None

    @property
    def distinguishable(self) -> bool | None:
        """Whether a stale engine (still on the previous version) would have failed this check."""
        return None if self.separation is None else self.separation > 2 * self.bound


def check_probe(
    engine: list[float], trainer: torch.Tensor, previous: torch.Tensor | None, bound: float, where: str, version: int
) -> ProbeResult:
    """Compare the engine's probe log-probabilities with the trainer's; raise ``StaleEngineError`` past the bound."""
    got = torch.tensor(engine, dtype=torch.float64)
    if got.shape != trainer.shape:
        raise StaleEngineError(
            f"the engine at {where} scored {got.numel()} probe positions, expected {trainer.numel()}"
        )
    diff = (got - trainer).abs()
    separation = None if previous is None else float((trainer - previous).abs().max())
    result = ProbeResult(version, float(diff.max()), float(diff.mean()), bound, separation)
    if not bool(torch.isfinite(got).all()) or result.max_abs_diff > bound:
        stale = ""
        if previous is not None and float((got - previous).abs().max()) <= bound:
            stale = " It matches the previous version: the engine did not take the new weights."
        raise StaleEngineError(
            f"the rollout engine at {where} does not serve policy version {version}: its log-probabilities on the "
            f"probe differ from the trainer's by up to {result.max_abs_diff:.3g} (bound {bound:.3g}).{stale} "
            "No rollout of this version is used. Check that the engine loads the published weights (vLLM: started "
            "with the ars-opd worker extension, or --weight-transfer-config for transport nccl; see the README's "
            "engine rollouts section)."
        )
    return result
