"""Compare the paper's seed scenarios (S1-1 strict, S1-2 mild, S1-3 significant) across DVC experiments.

Input: the JSON of ``dvc exp show --json`` (experiments queued with ``-S ddp.scenario=…``). For each
experiment it takes the scenario from the params and the report stage's metrics (mean loss dispersion,
gradient-norm dispersion, direction consistency, silent steps and loss spikes per training stage) and
renders a markdown comparison with the paper's expected ordering checked row by row: dispersion
S1-1 < S1-2 < S1-3, direction consistency the reverse, global loss smooth in all.

Only reads numbers; nothing is tuned towards the expected ordering.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

SCENARIOS = ("S1-1", "S1-2", "S1-3")
COLUMNS = (("loss_dispersion_mean", "loss dispersion", "up"),
           ("grad_norm_dispersion_mean", "grad-norm dispersion", "up"),
           ("grad_direction_consistency_mean", "direction consistency", "down"),
           ("silent_steps", "silent steps", None),
           ("loss_spikes", "global-loss spikes", None))


def _walk_experiments(data: Any):
    """Yield (name, params, metrics) for every experiment in `dvc exp show --json` output."""
    queue = list(data if isinstance(data, list) else [data])  # ExpState dicts; experiments hold ExpRanges
    while queue:
        exp = queue.pop(0)
        for exp_range in exp.get("experiments") or []:
            for rev in exp_range.get("revs") or []:
                queue.append({**rev, "name": rev.get("name") or exp_range.get("name"), "_experiment": True})
        d = exp.get("data") or {}
        params = ((d.get("params") or {}).get("params.yaml") or {}).get("data") or {}
        metrics: dict = {}
        for m in (d.get("metrics") or {}).values():
            metrics.update(m.get("data") or {})
        yield exp.get("name") or exp.get("rev"), params, metrics, bool(exp.get("_experiment"))


def collect(data: Any) -> dict[str, dict]:
    """scenario -> {name, metrics}: the first experiment of each scenario, else a baseline revision."""
    found: dict[str, dict] = {}
    baselines: dict[str, dict] = {}
    for name, params, metrics, is_experiment in _walk_experiments(data):
        scenario = (params.get("ddp") or {}).get("scenario")
        if scenario in SCENARIOS and any(k.endswith("_mean") for k in metrics):
            target = found if is_experiment else baselines
            target.setdefault(scenario, {"name": name, "metrics": metrics})
    return {s: found.get(s) or baselines[s] for s in SCENARIOS if s in found or s in baselines}


def render(found: dict[str, dict], commands: str, notes: str = "") -> str:
    lines = ["# Seed scenarios: does dispersion rise and direction consistency fall from S1-1 to S1-3?", "",
             "Made from a real run of the default pipeline with these commands:", "", "```", commands.strip(), "```",
             ""]
    missing = [s for s in SCENARIOS if s not in found]
    if missing:
        lines += [f"Missing scenarios in the experiments found: {missing}.", ""]
    for stage in ("sft", "opd"):
        lines += [f"## {stage}", "", "| scenario | experiment | " + " | ".join(c[1] for c in COLUMNS) + " |",
                  "|---|---|" + "---|" * len(COLUMNS)]
        for s in SCENARIOS:
            if s in found:
                m = found[s]["metrics"]
                cells = [_fmt(m.get(f"{stage}/{key}")) for key, _, _ in COLUMNS]
                lines.append(f"| {s} | {found[s]['name']} | " + " | ".join(cells) + " |")
        lines.append("")
        for key, label, direction in COLUMNS:
            if direction is None:
                continue
            values = [found[s]["metrics"].get(f"{stage}/{key}") for s in SCENARIOS if s in found]
            if len(values) == 3 and all(isinstance(v, (int, float)) for v in values):
                holds = values[0] < values[1] < values[2] if direction == "up" else values[0] > values[1] > values[2]
                expected = "S1-1 < S1-2 < S1-3" if direction == "up" else "S1-1 > S1-2 > S1-3"
                lines.append(f"- {label}: paper's ordering {expected} **{'holds' if holds else 'does not hold'}** "
                             f"here ({', '.join(_fmt(v) for v in values)}).")
        lines.append("")
    if notes.strip():
        lines += [notes.strip(), ""]
    return "\n".join(lines) + "\n"


def _fmt(v) -> str:
    return "n/a" if v is None else (f"{v:.4g}" if isinstance(v, float) else str(v))


def exp_show_json(cwd: str = ".") -> Any:
    out = subprocess.run(["dvc", "exp", "show", "--json", "--all-commits"], cwd=cwd, capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)
