"""The pruned-recovery study page's two long sections: each on-policy arm's rollouts (the rollout-health verdict of
every seed, a summary line and the dashboard) and the collapse diagnosis (``studies/opd_collapse.py``'s
measurements). Text only; ``ars_opd.evaluation.recovery`` assembles the page.
"""

from __future__ import annotations

from typing import Callable

import pandas as pd

from ars_opd.evaluation.rollout_dashboard import dashboard_section, has_rollouts, health_line
from ars_opd.evaluation.tables import fmt


def rollout_sections(
    logs: dict[str, list[pd.DataFrame]], batch: int | None = None, label: Callable[[str], str] = str
) -> list[str]:
    """Each on-policy arm's rollouts: the rollout-health verdict of each seed's own log
    (``ars_opd.training.opd.rollout_health``; ``batch``: the rollouts per step of a log older than its ``task/rollouts``
    column), a summary line (the EOS rate, truncation and length at the first own-sample step and over the last
    fifth), and the dashboard (``rollout_dashboard``) over the steps that trained on the student's own samples
    (``task/on_policy``), each step the mean over the seeds that sampled at it, with every seed's EOS rate beside
    the mean: a collapse in one seed is not averaged away. ``label``: an arm's name on the page."""
    lines, summary = [], []
    for arm, frames in logs.items():
        frames = [f for f in frames if not f.empty and has_rollouts(f)]
        verdicts = [health_line(f"{label(arm)}, seed {i + 1}", f, batch=batch) for i, f in enumerate(frames)]
        # only the steps on the student's own samples: a GKD step on the teacher's completions describes the
        # teacher's text, not the student's rollouts (the on-policy steps differ by seed, so rows are pooled)
        frames = [f[f["task/on_policy"] == 1] if "task/on_policy" in f else f for f in frames]
        frames = [f for f in frames if not f.empty]
        if not frames:
            continue  # no rollouts (an arm on the teacher's completions alone: λ = 0)
        pooled = pd.concat(frames, ignore_index=True).groupby("step", as_index=False).mean(numeric_only=True)
        per_seed = None
        if "task/eos_rate" in pooled:
            per_seed = [
                [float(e) for e in f.set_index("step")["task/eos_rate"].reindex(pooled["step"]).tolist()]
                for f in frames
            ]
        name = f"{label(arm)} (its steps on its own samples, mean over the {len(frames)} seeds that had each)"
        md, flat = dashboard_section(name, pooled, per_seed_eos=per_seed)
        alarms = sum(v.startswith("**") for v in verdicts)
        lines += md[:2] + [f"- {v}" for v in verdicts if v] + [""] + md[2:]
        key = f"{name}/rollouts/"
        moves = [
            f"{what} {fmt(flat[key + col + '_start'], pct)} → {fmt(flat[key + col + '_end'], pct)}"
            for col, what, pct in (
                ("eos_rate", "EOS rate", True),
                ("truncation_rate", "cut at max_new_tokens", True),
                ("response_length", "mean length (tokens)", False),
                ("divergence_second_half", "divergence in the second half", False),
            )
            if key + col + "_start" in flat and key + col + "_end" in flat
        ]
        if moves:
            summary.append(
                f"- {label(arm)}, its own samples, first step → last fifth of its steps (mean over seeds): "
                + ", ".join(moves)
                + f"; rollout-health alarm in {alarms} of {len(verdicts)} seeds."
            )
    return (summary + [""] if summary else []) + lines


def diagnosis_section(lines: list[dict]) -> list[str]:
    """The collapse diagnosis (``studies/opd_collapse.py``'s JSON lines) as markdown: the teacher's and the start's
    own EOS rates, each divergence's push on the EOS logit, the bf16 teacher against fp32, and the short runs (one
    setting changed per arm) with their trajectories. Numbers only; the reading is the notes' (``--notes``)."""
    by_kind: dict[str, list[dict]] = {}
    for x in lines:
        by_kind.setdefault(x.get("kind", ""), []).append(x)
    out: list[str] = []
    if by_kind.get("eos_rates"):
        r = by_kind["eos_rates"][0]
        out += [
            "### Does the teacher itself end within the budget?",
            "",
            "The share of answers that end with an EOS on training prompts, greedy and sampled at temperature 1:",
            "",
            "| model | greedy, 48 tokens | sampled, 48 | greedy, 128 | sampled, 128 |",
            "|---|---|---|---|---|",
        ]
        for who in ("teacher", "start"):
            cells = [fmt(r.get(f"{who}/{m}/{n}"), True) for n in (48, 128) for m in ("greedy", "sampled")]
            out.append(f"| {who} | " + " | ".join(cells) + " |")
        out.append("")
    if by_kind.get("eos_gradient"):
        g = by_kind["eos_gradient"][0]
        out += [
            "### The divergences' push on the end token",
            "",
            f"On {g.get('rollouts')} of the start's own rollouts (temperature 1, 48 tokens; "
            f"{fmt(g.get('student_eos_rate'), True)} ended), minus the gradient of each position's divergence "
            "with respect to the EOS logit: what one step of gradient descent moves that logit by, per unit of "
            "learning rate, before the optimiser's scaling (positive: towards ending). Where the student ended, its "
            f"own q(EOS) averaged {fmt(g.get('mean q(EOS) where the student ended'))} and the teacher's p(EOS) "
            f"{fmt(g.get('mean p(EOS) where the student ended'))}.",
            "",
            "| divergence | where the student ended and p_T(EOS) < 0.5 | where p_T(EOS) ≥ 0.5 and the student went on "
            "| all positions, summed per rollout |",
            "|---|---|---|---|",
        ]
        names = {"beta=1.0": "reverse KL (β = 1)", "beta=0.5": "JSD (β = 0.5)", "beta=0.0": "forward KL (β = 0)"}
        for key, name in names.items():
            d = g.get(key) or {}
            a, b = d.get("ends_teacher_would_not") or {}, d.get("teacher_would_end") or {}
            out.append(
                f"| {name} | {fmt(a.get('mean_push'))} (n = {a.get('positions')}) | {fmt(b.get('mean_push'))} "
                f"(n = {b.get('positions')}) | {fmt(d.get('per_rollout_mean_push'))} |"
            )
        out.append("")
    if by_kind.get("bf16_teacher"):
        t = by_kind["bf16_teacher"][0]
        out += [
            "### The teacher in bf16",
            "",
            f"On {t.get('rows')} held-out rows ({t.get('tokens')} tokens of the teacher's completions), the teacher "
            "in fp32 against bf16 weights under bf16 autocast (what `precision: auto` and `teacher_dtype: auto` "
            "give on CUDA; this CPU's bf16 kernels stand in for the GPU's): NLL of its own completions "
            f"{fmt(t.get('nll_fp32'))} (fp32) against {fmt(t.get('nll_bf16'))} (bf16), and "
            f"KL(fp32 teacher ‖ bf16 teacher) {fmt(t.get('kl_fp32_bf16'))} per token.",
            "",
        ]
    runs = by_kind.get("short_run") or []
    if runs:
        out += [
            "### Short runs, one setting changed at a time",
            "",
            "OPD from the same start, each arm one change from the old OPD (reverse KL, λ = 1, temperature 1, fp32), "
            "its on-policy steps (λ < 1 trains some steps on the teacher's text): the first three on-policy steps "
            "against the last three, and the rollout-health verdict.",
            "",
            "| arm | change | on-policy steps | EOS rate | length (tokens) | student entropy | teacher log p / token "
            "| loss | alarm |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        base = next((r["opd"] for r in runs if r["arm"] == "opd"), {})
        for r in runs:
            change = ", ".join(f"{k} = {v}" for k, v in r["opd"].items() if base.get(k) != v) or "none (old OPD)"

            def move(key: str, pct: bool = False) -> str:
                return f"{fmt(r.get(key + '_start'), pct)} → {fmt(r.get(key + '_end'), pct)}"

            alarm = r.get("alarm")
            a = "none" if not alarm else f"step {alarm['step']} ({alarm['kind'].replace('_', ' ')})"
            out.append(
                f"| {r['arm']} | {change} | {r.get('steps')} | {move('eos_rate', True)} | {move('response_length')} "
                f"| {move('entropy')} | {move('teacher_logprob')} | {move('loss')} | {a} |"
            )
        out.append("")
    out += precision_table(by_kind.get("precision_run") or [])
    return out


def precision_table(runs: list[dict]) -> list[str]:
    """``studies/opd_collapse.py``'s precision runs (one arm's runs under several precisions and devices, seed by
    seed) as a table: how each seed's rollouts ended at the start and the end, its collapse step and its alarm."""
    if not runs:
        return []
    first = max(len(r.get("eos_first") or []) for r in runs)
    span = runs[0].get("collapse_span", 5)
    out = [
        "### The GPU's precision path on this CPU",
        "",
        f"One arm's runs, seed by seed, under each precision and device: the EOS rate of its first {first} "
        f"on-policy steps, the collapse step (the first on-policy step from which no rollout ended for {span} steps "
        "in a row), how many on-policy steps ended no rollout, the EOS rate of its last 12, the student's entropy "
        "at its samples and the teacher's log p of them (first three on-policy steps → last 12; n/a where the log "
        "predates the column), and the rollout-health verdict. The params column is what the run's params said "
        "(`opd.precision`, `opd.teacher_dtype`; auto is bf16 on CUDA and fp32 on CPU).",
        "",
        "| run | seed | params | EOS rate, first steps | collapse step | steps with none ended "
        "| EOS rate, last 12 | student entropy | teacher log p / token | alarm |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        opd = r.get("opd") or {}
        eos = " ".join(f"{v:.2f}" for v in r.get("eos_first") or [])
        collapse = "none" if r.get("collapse_step") is None else str(r["collapse_step"])
        alarm = r.get("alarm")
        a = "none" if not alarm else f"step {alarm['step']} ({alarm['kind'].replace('_', ' ')})"

        def move(key: str) -> str:
            return f"{fmt(r.get(key + '_start'))} → {fmt(r.get(key + '_end'))}"

        out.append(
            f"| {r.get('group')} | {r.get('seed')} | {opd.get('precision')}, {opd.get('teacher_dtype')} | {eos} "
            f"| {collapse} | {r.get('steps_none_ended')} of {r.get('steps')} | {fmt(r.get('eos_rate_end'), True)} "
            f"| {move('entropy')} | {move('teacher_logprob')} | {a} |"
        )
    out.append("")
    return out
