"""What each OPD loss needs from the teacher and demands of the rollouts, and the params check built on it.

Torch-free on purpose: ``ars_opd.config.load_params`` runs ``check_config`` for every stage (so "valid
params" means one thing), and what config imports every stage depends on. The losses themselves, with
these rules attached, are the registry of ``ars_opd.lm.objectives``; a new loss is one entry here and one
there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from ars_opd.config import ConfigError, OPDConfig


@dataclass(frozen=True)
class ObjectiveRules:
    name: str
    teacher_signal: Literal["logits", "token_logprobs", "topk"]
    """What the teacher must provide."""
    uses_beta: bool
    """Whether ``opd.beta`` means anything (else it must stay 1.0)."""
    exact_on_policy: bool
    """The gradient is right only for pure student samples at the loss temperature (λ = 1, top_p = 1)."""


RULES: dict[str, ObjectiveRules] = {r.name: r for r in (
    ObjectiveRules("full_vocab", "logits", uses_beta=True, exact_on_policy=False),
    ObjectiveRules("sampled_token", "token_logprobs", uses_beta=False, exact_on_policy=True),
    ObjectiveRules("topk", "topk", uses_beta=True, exact_on_policy=False),
)}


def check_config(cfg: OPDConfig) -> ObjectiveRules:
    """The rules of the loss ``cfg.loss`` names, if ``cfg`` lets it train correctly; else ``ConfigError``
    naming the key."""
    if cfg.loss not in RULES:
        raise ConfigError("opd.loss", f"must be one of {list(RULES)}, got {cfg.loss!r}")
    rules = RULES[cfg.loss]
    if cfg.teacher == "endpoint":  # a served teacher returns log-probabilities at τ = 1, top-k at most
        if rules.teacher_signal == "logits":
            raise ConfigError("opd.loss", f"the {cfg.loss} loss needs the teacher's full distribution, which a "
                                          "scoring endpoint does not return; with opd.teacher: endpoint use "
                                          "sampled_token (exact) or topk (top-k approximation)")
        if rules.teacher_signal == "token_logprobs" and cfg.temperature != 1.0:
            raise ConfigError("opd.temperature", f"an endpoint's prompt_logprobs are log-softmax at temperature 1 "
                                                 f"and log p_T(y) at τ = {cfg.temperature} needs the whole "
                                                 f"distribution; set 1.0 with opd.teacher: endpoint (or use topk, "
                                                 "which renormalises over the top-k at τ)")
    if not rules.uses_beta and cfg.beta != 1.0:
        raise ConfigError("opd.beta", f"the {cfg.loss} loss estimates reverse KL only; set beta: 1.0")
    if rules.exact_on_policy:  # its gradient is right only for tokens drawn from q at the temperature
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
    return rules
