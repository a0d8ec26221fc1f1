"""The on-policy distillation losses, chosen by name (``opd.loss``) from one registry.

An ``Objective`` says what it needs from the teacher and what it demands of the rollouts, and computes
the step's summed loss from the student's logits and the teacher's scores. ``check_config`` (run by the
opd stage before it starts workers, and by ``ars-opd params``) and the OPD trainer read only this
registry, so a new loss is one new entry here.

- ``full_vocab``: ``token_divergence`` (β: 0 forward KL, 1 reverse KL, in between generalised JSD) at
  temperature τ, exact over the vocabulary; needs the teacher's logits.
- ``sampled_token``: the policy-gradient estimator of reverse KL from the teacher's log-probability of
  the sampled tokens alone. Its value is the reverse-KL estimate Σ(log q − log p) of those tokens and its
  gradient the surrogate's (−Σ A·log q is often negative and is no divergence, so it is never logged). The
  gradient is reverse KL's only for tokens drawn from the student at τ with no nucleus cut-off and no
  teacher-written completions, hence ``exact_on_policy``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch

from ars_opd.config import ConfigError, OPDConfig
from ars_opd.lm.divergences import sampled_token_loss, token_divergence


@dataclass
class TeacherScores:
    """What the teacher said about a batch: (B, T, V) logits over the shared vocabulary, and/or (B, T)
    log-probabilities of the target tokens at the objective's temperature."""

    logits: torch.Tensor | None = None
    token_logprobs: torch.Tensor | None = None


LossFn = Callable[[torch.Tensor, TeacherScores, torch.Tensor, torch.Tensor, float, float, int],
                  tuple[torch.Tensor, int]]


@dataclass(frozen=True)
class Objective:
    name: str
    teacher_signal: Literal["logits", "token_logprobs"]
    """What the teacher must provide."""
    uses_beta: bool
    """Whether ``opd.beta`` means anything (else it must stay 1.0)."""
    exact_on_policy: bool
    """The gradient is right only for pure student samples at the loss temperature (λ = 1, top_p = 1)."""
    loss: LossFn
    """(student logits (B, T, V), teacher scores, mask (B, T) bool, targets (B, T), beta, temperature,
    chunk_size) -> (summed loss with grad, token count)."""


def _full_vocab(logits, teacher, mask, targets, beta, temperature, chunk_size):
    return token_divergence(logits, teacher.logits, mask, beta, temperature, chunk_size)


def _sampled_token(logits, teacher, mask, targets, beta, temperature, chunk_size):
    surrogate, estimate, n = sampled_token_loss(logits, teacher.token_logprobs, targets, mask, temperature)
    return surrogate + (estimate - surrogate).detach(), n  # value: the estimate; gradient: the surrogate's


OBJECTIVES: dict[str, Objective] = {o.name: o for o in (
    Objective("full_vocab", "logits", uses_beta=True, exact_on_policy=False, loss=_full_vocab),
    Objective("sampled_token", "token_logprobs", uses_beta=False, exact_on_policy=True, loss=_sampled_token),
)}


def get_objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise KeyError(f"unknown OPD loss {name!r}; known: {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def check_config(cfg: OPDConfig) -> Objective:
    """The objective ``cfg.loss`` names, if ``cfg`` lets it train correctly; else ``ConfigError`` naming the key."""
    if cfg.loss not in OBJECTIVES:
        raise ConfigError("opd.loss", f"must be one of {list(OBJECTIVES)}, got {cfg.loss!r}")
    objective = OBJECTIVES[cfg.loss]
    if not objective.uses_beta and cfg.beta != 1.0:
        raise ConfigError("opd.beta", f"the {cfg.loss} loss estimates reverse KL only; set beta: 1.0")
    if objective.exact_on_policy:  # its gradient is right only for tokens drawn from q at the temperature
        if cfg.on_policy_fraction != 1.0:
            raise ConfigError("opd.on_policy_fraction",
                              f"the {cfg.loss} loss needs tokens sampled from the student (teacher completions "
                              f"would bias its gradient with no importance weight); set 1.0, got "
                              f"{cfg.on_policy_fraction}")
        if cfg.sample_temperature != cfg.temperature or cfg.top_p != 1.0:
            raise ConfigError("opd.sample_temperature",
                              f"the {cfg.loss} loss needs rollouts from the distribution it differentiates: "
                              f"sample_temperature == temperature ({cfg.temperature}) and top_p == 1.0, got "
                              f"{cfg.sample_temperature} and {cfg.top_p}")
    return objective
