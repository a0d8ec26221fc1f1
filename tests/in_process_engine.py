"""A rollout engine in this process, client and transport at once, for the schedule's tests that need neither
HTTP nor a server (importable by spawned workers: tests/ is on their sys.path).

``RecordingEngine(model)`` keeps its own fp32 copy of ``model``: ``publish`` loads a version into it (a tied head
left out, as the trainer publishes it, and re-tied), ``prompt_logprobs`` scores the probe with that copy in eval
mode, ``fingerprint`` hashes it as the bundled server does, and ``generate`` answers one token per prompt and
records, for the step its prompts belong to (``prompt[0] - 10``), the version it held when asked.
"""

from __future__ import annotations

import copy

import torch

from ars_opd.rollouts.engine_api import Rollout
from ars_opd.rollouts.verify import trainer_logprobs
from ars_opd.rollouts.weights import Transfer


class RecordingEngine:
    url = "in-process"
    model_name = "in-process"

    def __init__(self, model: torch.nn.Module):
        self.model, self.version = copy.deepcopy(model).float().eval(), None
        self.sampled_by: dict[int, int] = {}
        self.published: list[int] = []

    def publish(self, state, version):
        self.model.load_state_dict(state, strict=False)
        self.version = version
        self.published.append(version)
        return Transfer(0, 0.0, 0.0)

    def close(self):
        pass

    def prompt_logprobs(self, ids):
        return trainer_logprobs(self.model, ids, torch.device("cpu"))[0].tolist()

    def reset_prefix_cache(self):
        pass  # no prefix cache

    def fingerprint(self):
        from ars_opd.serving.server.weights import state_fingerprint

        return {"tensors": state_fingerprint(self.model)}

    def generate(self, prompts, spec, seeds):
        self.sampled_by[prompts[0][0] - 10] = self.version
        return [Rollout([2], [-1.0], "stop") for _ in prompts]
