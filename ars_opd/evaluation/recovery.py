"""The pruned-recovery study's page: several distillation arms against continued SFT, over paired training seeds.

``studies/pruned_recovery.py`` runs the study: from one start (the real profile's SFT'd pruned student), per training
seed, the control (``sft_continued``: more SFT on the teacher's completions) and one ``opd`` stage run per arm
(the arms differ in the opd section's objective only: divergence β, on-policy share λ, loss), each evaluated by
the evaluate stage against that seed's control. Every arm therefore comes with an evaluation whose ``opd`` entry is
the arm and whose ``sft_continued`` entry is the control, and is compared exactly as the seed sweep compares OPD
with its control (``ars_opd.evaluation.distillation``: the same ``equal_budget.compare``, the same paired
t-intervals, the same positive control). This module adds what several arms need: one table of every arm at
equal steps and at equal FLOPs, the curves of every arm in one figure, the rollouts of each on-policy arm
(``rollout_dashboard``), and a verdict per arm. Text and arithmetic only; the runs are read by the bench script.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from ars_opd.evaluation.distillation import comparison, control_table, instrument_control, interval_cell
from ars_opd.evaluation.equal_budget import METRICS, compare, interpolate
from ars_opd.evaluation.recovery_sections import diagnosis_section, rollout_sections
from ars_opd.evaluation.stats import mean_ci, one_difference
from ars_opd.evaluation.tables import LENGTH_PROOF, OWN, fmt

CONTROL = "sft"
# the cross-tokenizer arms without the span baseline say so, whatever the profile under them sets
_NO_BASELINE = {"span_baseline": "none"}
TITLE = "# Recovering a depth-pruned real model: distillation arms against continued SFT"

# arm -> (label, what it is, the opd section's overrides; None: the control, the sft_continued stage)
ARMS: dict[str, tuple[str, str, dict | None]] = {
    CONTROL: (
        "SFT on teacher completions (control)",
        "sequence-level KD: more SFT on the teacher's greedy completions (the `sft_continued` stage)",
        None,
    ),
    "kd": (
        "supervised KD (forward KL, λ = 0)",
        "full-vocabulary forward KL to the teacher on the teacher's completions (Minitron-style recovery)",
        {"loss": "full_vocab", "beta": 0.0, "on_policy_fraction": 0.0},
    ),
    "opd": (
        "OPD, reverse KL (λ = 1)",
        "full-vocabulary reverse KL on the student's own samples",
        {"loss": "full_vocab", "beta": 1.0, "on_policy_fraction": 1.0},
    ),
    "gkd": (
        "GKD, JSD(β = 0.5), λ = 0.5",
        "generalised JSD at β = 0.5, on the student's samples on half the steps, the teacher's completions on the rest",
        {"loss": "full_vocab", "beta": 0.5, "on_policy_fraction": 0.5},
    ),
    "opd_lambda05": (
        "OPD, reverse KL, λ = 0.5",
        "full-vocabulary reverse KL, on the student's samples on half the steps and the teacher's completions on the "
        "rest (GKD's λ without its β)",
        {"loss": "full_vocab", "beta": 1.0, "on_policy_fraction": 0.5},
    ),
    "opd_lambda025": (
        "OPD, reverse KL, λ = 0.25",
        "full-vocabulary reverse KL, on the student's samples on a quarter of the steps and the teacher's completions "
        "on the rest",
        {"loss": "full_vocab", "beta": 1.0, "on_policy_fraction": 0.25},
    ),
    "opd_lambda010": (
        "OPD, reverse KL, λ = 0.1",
        "full-vocabulary reverse KL, on the student's samples on a tenth of the steps and the teacher's completions "
        "on the rest",
        {"loss": "full_vocab", "beta": 1.0, "on_policy_fraction": 0.1},
    ),
    "opd_sharp": (
        "OPD, sharpened teacher (τ_T = 0.5)",
        "full-vocabulary reverse KL on the student's own samples against the teacher at temperature 0.5 "
        "(`opd.teacher_temperature`), whose most likely token is its greedy choice",
        {"loss": "full_vocab", "beta": 1.0, "on_policy_fraction": 1.0, "teacher_temperature": 0.5},
    ),
    "opd_sharp_anchor": (
        "OPD, sharpened teacher + SFT anchor",
        "the sharpened teacher's reverse KL on the student's samples, and in the same step the SFT loss on the "
        "teacher's completions of the step's prompts at weight 0.5 (`opd.anchor: sft`)",
        {
            "loss": "full_vocab",
            "beta": 1.0,
            "on_policy_fraction": 1.0,
            "teacher_temperature": 0.5,
            "anchor": "sft",
            "anchor_weight": 0.5,
        },
    ),
    "opd_anchor": (
        "OPD + SFT anchor",
        "full-vocabulary reverse KL on the student's own samples against the teacher at temperature 1, and in the same "
        "step the SFT loss on the teacher's completions of the step's prompts at weight 0.5 (`opd.anchor: sft`): the "
        "anchored arm without the sharpened teacher",
        {"loss": "full_vocab", "beta": 1.0, "on_policy_fraction": 1.0, "anchor": "sft", "anchor_weight": 0.5},
    ),
    "opd_anchor1": (
        "OPD + SFT anchor at weight 1",
        "the anchored arm with the plain teacher, its SFT loss on the teacher's completions at weight 1 instead of 0.5 "
        "(`opd.anchor_weight: 1.0`)",
        {"loss": "full_vocab", "beta": 1.0, "on_policy_fraction": 1.0, "anchor": "sft", "anchor_weight": 1.0},
    ),
    "constant": (
        "fixed negative advantage (control)",
        "the sampled-token policy gradient with every token's advantage −1 (`loss: constant_advantage`): the "
        "teacher's signal replaced by a constant, to see whether OPD's effect needs the teacher at all",
        {"loss": "constant_advantage", "beta": 1.0, "on_policy_fraction": 1.0, "constant_advantage": -1.0},
    ),
    "opd_sampled": (
        "OPD, sampled-token reverse KL",
        "the single-sample estimator of reverse KL's gradient from the sampled tokens' teacher log-probabilities",
        {"loss": "sampled_token", "beta": 1.0, "on_policy_fraction": 1.0},
    ),
    "xtok_sampled": (
        "OPD across tokenizers, span sampled-token reverse KL",
        "the student's text scored by the teacher in its own tokens; each span both tokenisations share carries its "
        "log-ratio log q − log p as its tokens' credit, the sequence estimate exact by the chain rule "
        "(`opd.cross_tokenizer`, `opd.loss: sampled_token`)",
        {"loss": "sampled_token", "beta": 1.0, "on_policy_fraction": 1.0, "cross_tokenizer": True, **_NO_BASELINE},
    ),
    "xtok_sampled_loo": (
        "OPD across tokenizers, span sampled-token reverse KL, leave-one-out baseline",
        "as the span sampled-token arm, each span's credit less the mean credit of the micro-batch's other rollouts, "
        "a control variate that keeps the expected gradient (`opd.span_baseline: leave_one_out`)",
        {
            "loss": "sampled_token",
            "beta": 1.0,
            "on_policy_fraction": 1.0,
            "cross_tokenizer": True,
            "span_baseline": "leave_one_out",
        },
    ),
    "xtok_vocab": (
        "OPD across tokenizers, shared vocabulary + ULD",
        "at each span's first token, reverse KL over the tokens both vocabularies spell alike (plus one bucket for "
        "the rest) and ULD's sorted-probability distance on the rest (`opd.loss: cross_vocab`)",
        {"loss": "cross_vocab", "beta": 1.0, "on_policy_fraction": 1.0, "cross_tokenizer": True, **_NO_BASELINE},
    ),
}
VIEW_KEYS = ("equal_steps", "equal_flops", "equal_total_flops")
# the page's figures: the pipeline's three, and those a change of length cannot game: reverse KL at the teacher's
# own prefixes, whole and their first sentence (the student never chooses where it is scored), exact match of a
# sample at temperature 1 (an answer that never ends is wrong however it is read), and the own-sample reverse KL
# summed per sequence (which never-ending samples raise where the per-token mean hides them)
# the length-proof figures (their labels are evaluate's table's, ``tables.LENGTH_PROOF``): judged like the others,
# lower reverse KL and higher exact match being better
STUDY_METRICS = (
    *METRICS,
    *((k, lbl, "higher" if k.startswith("exact_match") else "lower") for k, lbl, _ in LENGTH_PROOF if k not in OWN),
)
# the verdict's figures: all but the NLL of the teacher's completions (an SFT arm's own loss)
VERDICT_METRICS = ("reverse_kl", "exact_match", "reverse_kl_fixed_prefix", "exact_match_sampled")
# how the models' own samples end (evaluate's own_eos_rate, own_length): read beside the figures, not judged
OWN_SAMPLES = tuple(c for c in LENGTH_PROOF if c[0] in OWN)


def _pct(metric: str) -> bool:
    return metric.startswith("exact_match") or metric == "own_eos_rate"


def measured(by_arm: dict[str, list[dict]], metrics: tuple = STUDY_METRICS) -> tuple:
    """The ``metrics`` some arm's or control's evaluation holds a value of: a study evaluated before a figure
    existed gets no column of empty cells for it."""
    entries = [r["evaluate"].get(k) or {} for runs in by_arm.values() for r in runs for k in ("opd", "sft_continued")]
    return tuple(m for m in metrics if any(e.get(m[0]) is not None for e in entries))


# the figures a cross-tokenizer evaluation cannot take: a per-token reverse KL at the teacher's own prefixes compares
# two next-token distributions over one vocabulary, and a student and a teacher with different tokenizers share none
NO_SHARED_VOCABULARY = ("reverse_kl_fixed_prefix", "reverse_kl_first_sentence")
CROSS_TOKENIZER_KIND = "sampled_cross_tokenizer"  # evaluate's reverse_kl_kind in a cross-tokenizer run


def unmeasured_lines(by_arm: dict[str, list[dict]], unmeasured_keys: list[str]) -> list[str]:
    """Why a figure of the study's tables has no column: in runs across tokenizers (every evaluation's
    ``reverse_kl_kind`` the cross-tokenizer one) the fixed-prefix reverse KLs cannot be taken at all; any other
    missing figure was not measured because the runs' evaluation predates it."""
    if not unmeasured_keys:
        return []
    labels = {k: lbl for k, lbl, _ in STUDY_METRICS + OWN_SAMPLES}
    kinds = {r["evaluate"].get("reverse_kl_kind") for runs in by_arm.values() for r in runs}
    cross = kinds == {CROSS_TOKENIZER_KIND}
    no_vocab = [k for k in unmeasured_keys if cross and k in NO_SHARED_VOCABULARY]
    older = [k for k in unmeasured_keys if k not in no_vocab]
    lines = []
    if no_vocab:
        lines += [
            f"Not measurable across tokenizers: {'; '.join(labels[k] for k in no_vocab)}. It compares the student's "
            "and the teacher's next-token distributions over one vocabulary at the teacher's prefixes, and these "
            "two models share none; the reverse KL on own samples is the sampled estimate over the teacher's own "
            "tokens.",
            "",
        ]
    if older:
        lines += [
            f"Not measured by these runs' evaluation (it predates them): {'; '.join(labels[k] for k in older)}.",
            "",
        ]
    return lines


def cross_tokenizer_arm(arm: str) -> bool:
    """Whether ``arm`` distils across tokenizers (it then needs a models stage run with opd.cross_tokenizer, and the
    same-tokenizer arms' full-vocabulary losses cannot run beside it)."""
    return bool((ARMS.get(arm, (None, None, None))[2] or {}).get("cross_tokenizer"))


SAME_TOKENIZER_ARMS = tuple(a for a in ARMS if not cross_tokenizer_arm(a))
CROSS_TOKENIZER_ARMS = (CONTROL, *(a for a in ARMS if cross_tokenizer_arm(a)))


def label(arm: str) -> str:
    return ARMS[arm][0] if arm in ARMS else arm


def _paired_values(runs: list[dict], where: str, metric: str) -> tuple[list[float], list[float]]:
    """(arm, control) values of ``metric`` in view ``where``, one pair per seed that has both."""
    a, b = [], []
    for r in runs:
        c = compare(r["evaluate"], STUDY_METRICS) or {}
        view = c.get(where) or {}
        x, y = (view.get("opd") or {}).get(metric), (view.get("sft_continued") or {}).get(metric)
        if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
            a.append(x)
            b.append(y)
    return a, b


def summary_table(by_arm: dict[str, list[dict]], where: str) -> list[str]:
    """Markdown: every arm's metrics in view ``where`` (mean [95% t-interval over seeds], n seeds) and below them
    its paired difference from the control. At equal steps the control's own row comes first; at equal FLOPs
    the control is read at each pair's own budget (the cheaper arm's total), so it has no single row and each
    arm's difference is from the control at that arm's budget."""
    arms = [a for a in by_arm if by_arm[a]]
    if not arms:
        return []
    metrics = measured(by_arm)
    lines = ["| arm | " + " | ".join(lbl for _, lbl, _ in metrics) + " |", "|---|" + "---|" * len(metrics)]
    if where == "equal_steps":
        control_cells = []
        for metric, _, _ in metrics:
            _, b = _paired_values(by_arm[arms[0]], where, metric)
            control_cells.append(interval_cell(mean_ci(b), _pct(metric)) if len(b) >= 2 else "n/a")
        lines.append(f"| {label(CONTROL)} | " + " | ".join(control_cells) + " |")
    for arm in arms:
        cells = []
        for metric, _, _ in metrics:
            a, b = _paired_values(by_arm[arm], where, metric)
            if len(a) < 2:
                cells.append(f"n/a ({len(a)} seed(s))")
                continue
            pct = _pct(metric)
            diff = mean_ci([x - y for x, y in zip(a, b)])
            cells.append(f"{interval_cell(mean_ci(a), pct)}<br>− control: {interval_cell(diff, pct)} (n = {len(a)})")
        lines.append(f"| {label(arm)} | " + " | ".join(cells) + " |")
    return lines + [""]


def verdict(by_arm: dict[str, list[dict]]) -> list[str]:
    """One line per arm and view: better, worse or not resolved against the control on each of
    ``VERDICT_METRICS``, by whether the paired 95% interval excludes 0."""
    out = []
    for arm, runs in by_arm.items():
        bits = []
        for where, words in (("equal_steps", "equal steps"), ("equal_flops", "equal FLOPs")):
            for metric, lbl, direction in STUDY_METRICS:
                if metric not in VERDICT_METRICS:
                    continue
                a, b = _paired_values(runs, where, metric)
                if len(a) < 2:
                    continue
                pct = _pct(metric)
                m, lo, hi = mean_ci([x - y for x, y in zip(a, b)])
                if one_difference(a, b):
                    word = "not resolved (every seed gave the same difference)"
                elif (hi < 0) if direction == "lower" else (lo > 0):
                    word = "better than the control"
                elif (lo > 0) if direction == "lower" else (hi < 0):
                    word = "worse than the control"
                else:
                    word = "no difference resolved"
                bits.append(f"at {words}, {lbl}: {word} ({interval_cell((m, lo, hi), pct)})")
        if bits:
            out.append(f"- **{label(arm)}**: " + "; ".join(bits))
    return out


def start_table(by_arm: dict[str, list[dict]], base: str) -> list[str]:
    """The models every arm shares (the base student, the start, the teacher), as the first evaluation scored them.
    ``base`` names the first: the pruned copy of the teacher, or a complete student before any training."""
    ev = next((runs[0]["evaluate"] for runs in by_arm.values() if runs), {})
    rows = [(name, ev.get(key)) for key, name in (("base", base), ("sft", "start (SFT)"), ("teacher", "teacher"))]
    rows = [(name, m) for name, m in rows if m]
    if not rows:
        return []
    cols = [(k, lbl, _pct(k)) for k, lbl, _ in measured(by_arm, STUDY_METRICS + OWN_SAMPLES)]
    out = ["| model | " + " | ".join(lbl for _, lbl, _ in cols) + " |", "|---|" + "---|" * len(cols)]
    for name, m in rows:
        out.append(f"| {name} | " + " | ".join(fmt(m.get(k), pct) for k, _, pct in cols) + " |")
    return out + [""]


def own_samples_table(by_arm: dict[str, list[dict]]) -> list[str]:
    """How each arm's own samples of the held-out prompts end, at equal steps (mean [95% t-interval over seeds]):
    the control's row from every seed's evaluation, then each arm's; [] when no evaluation measured them. A run
    whose rollouts stop ending shows here whatever its reverse KL says."""
    rows = [(label(CONTROL), [r["evaluate"].get("sft_continued") or {} for r in next(iter(by_arm.values()), [])])]
    rows += [(label(arm), [r["evaluate"].get("opd") or {} for r in runs]) for arm, runs in by_arm.items()]
    body, measured = [], False
    for name, ms in rows:
        cells = []
        for key, _, pct in OWN_SAMPLES:
            xs = [m[key] for m in ms if isinstance(m.get(key), (int, float)) and math.isfinite(m[key])]
            measured |= len(xs) >= 2
            cells.append(f"{interval_cell(mean_ci(xs), pct)} (n = {len(xs)})" if len(xs) >= 2 else "n/a")
        body.append(f"| {name} | " + " | ".join(cells) + " |")
    if not measured:
        return []
    head = ["| arm | " + " | ".join(lbl for _, lbl, _ in OWN_SAMPLES) + " |", "|---|" + "---|" * len(OWN_SAMPLES)]
    return head + body + [""]


def curves_figure(by_arm: dict[str, list[dict]], x_key: str, path: Path) -> None:
    """One panel per metric, one line per arm (and the control): mean over seeds of the learning curve on the
    curve prompts, min-max band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METRICS), figsize=(15, 4))
    series = [(CONTROL, "sft_continued", next(iter(by_arm.values()), []))]
    series += [(arm, "opd", runs) for arm, runs in by_arm.items()]
    for ax, (metric, lbl, _) in zip(axes, METRICS):
        for arm, stage, runs in series:
            curves = [c for c in ((r["evaluate"].get("curves") or {}).get(stage) or [] for r in runs) if c]
            if not curves:
                continue
            xs = sorted({p[x_key] for c in curves for p in c})
            ys = np.array([[interpolate(c, x_key, x, metric) for x in xs] for c in curves], dtype=float)
            keep = ~np.any(np.isnan(ys), 0)  # where every seed has a value: no mean over a changing set of seeds
            xs, ys = np.asarray(xs)[keep], ys[:, keep]
            (line,) = ax.plot(xs, np.nanmean(ys, 0), label=label(arm))
            ax.fill_between(xs, np.nanmin(ys, 0), np.nanmax(ys, 0), color=line.get_color(), alpha=0.15)
        ax.set_xlabel("FLOPs from scratch" if x_key == "flops" else "optimiser steps from scratch")
        ax.set_title(lbl, fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def render(
    by_arm: dict[str, list[dict]],
    logs: dict[str, list[pd.DataFrame]],
    meta: dict,
    figures: dict[str, str],
) -> str:
    """The study's markdown. ``by_arm``: arm -> one run per seed ({"seed", "evaluate"}: the evaluation of that
    arm against that seed's control); ``logs``: arm -> its per-seed step logs; ``meta``: how it was run
    (command, seeds, steps, device, seconds, overrides; ``base``, the base student's row name)."""
    seeds = sorted({r["seed"] for runs in by_arm.values() for r in runs})
    lines = [
        meta.get("title") or TITLE,
        "",
        f"Made by `{meta.get('command', 'python studies/pruned_recovery.py')}` "
        f"in {meta.get('seconds', float('nan')) / 60:.1f} minutes on {meta.get('device', '?')}"
        + (f" (commit {meta['commit']})" if meta.get("commit") else "")
        + ".",
        "",
        f"Every arm starts from the same student, {meta.get('start', 'the SFT stage model')}, and runs the same "
        f"loop: {meta.get('steps')} optimiser steps of {meta.get('batch')} sequences, the opd section's "
        "learning-rate schedule and clipping. Only the objective and its data differ:",
        "",
    ]
    lines += [f"- **{label(a)}**: {ARMS[a][1]}." for a in [CONTROL, *by_arm] if a in ARMS]
    family = CROSS_TOKENIZER_ARMS if any(cross_tokenizer_arm(a) for a in by_arm) else SAME_TOKENIZER_ARMS
    skipped = [label(a) for a in family if a != CONTROL and a not in by_arm]
    if skipped:
        lines += [f"- Not run in this study: {', '.join(skipped)}."]
    if meta.get("rollouts"):
        lines += ["", f"The on-policy arms' rollouts: `opd.rollouts: {meta['rollouts']}`."]
    lines += [
        "",
        f"Seeds: {seeds} (`ddp.seed`, paired: seed s of every arm against seed s of the control). Each cell: mean "
        "over seeds [95% t-interval over training seeds]; the difference from the control is paired by seed. "
        "The held-out prompts are the same for every seed, so the intervals hold for these prompts. At equal "
        "FLOPs each arm is read off its learning curve (on the curve prompts) at the cheaper arm's total; the "
        "teacher's cost of the completions the SFT stage and the control trained on is counted in the third "
        "view.",
        "",
    ]
    missing = meta.get("missing") or []
    if missing:
        lines += [
            f"**{len(missing)} run(s) did not finish** and are left out, with their seed's pairs: "
            + ", ".join(f"`{m}`" for m in missing)
            + ". Each cell says how many seeds it has.",
            "",
        ]
    have = {k for k, _, _ in measured(by_arm, STUDY_METRICS + OWN_SAMPLES)}
    unmeasured = [m for m, _, _ in STUDY_METRICS + OWN_SAMPLES if m not in have]
    lines += unmeasured_lines(by_arm, unmeasured)
    lines += [
        "The shared models, on all the held-out prompts:",
        "",
        *start_table(by_arm, meta.get("base", "pruned base")),
    ]
    if meta.get("overrides"):
        base = f"the profile `{meta['profile']}` over params.yaml" if meta.get("profile") else "params.yaml"
        lines += [f"Params of every run, over {base}: `" + " ".join(meta["overrides"]) + "`.", ""]
    if meta.get("kept_params"):
        lines += [
            f"{len(meta['kept_params'])} run(s) kept the params they were trained with (`--keep-params`: they agree "
            "with these on the study's own keys; keys added to the code since are absent from them): "
            + ", ".join(f"`{r}`" for r in meta["kept_params"])
            + ".",
            "",
        ]
    tables = {}
    for where, title in (
        ("equal_steps", "At equal steps"),
        ("equal_flops", "At equal FLOPs"),
        ("equal_total_flops", "At equal FLOPs, the teacher's data cost counted"),
    ):
        table = summary_table(by_arm, where)
        tables[where] = table
        if len(table) <= 3:
            continue
        if where == "equal_total_flops" and table == tables.get("equal_flops"):
            lines += [
                f"## {title}",
                "",
                "The same as at equal FLOPs: every arm trains on rows the SFT stage paid for (or on its own samples), "
                "so each carries the same teacher's data cost.",
                "",
            ]
            continue
        lines += [f"## {title}", "", *table]
        own = own_samples_table(by_arm) if where == "equal_steps" else []
        if own:
            lines += ["How the models' own samples of the held-out prompts end, at equal steps:", "", *own]
    control = instrument_control(next(iter(by_arm.values()), []))
    if control:
        lines += [
            "## Can the study see an effect? (positive control)",
            "",
            "The control arm's improvement over the second half of its steps (its curve at the end minus half-way, "
            "paired by seed), measured with the same seeds and curve prompts. A difference between arms smaller "
            "than this is one the study may miss.",
            "",
            *control_table(control),
        ]
    for key, path in figures.items():
        lines += [f"![learning curves against {key}]({path})", ""]
    lines += ["## Verdict", "", *verdict(by_arm), ""]
    if meta.get("notes"):  # the study's reading, written by hand (--notes)
        lines += [meta["notes"].strip(), ""]
    if meta.get("diagnosis"):
        lines += ["## Why the rollouts stop ending: the diagnosis", "", *diagnosis_section(meta["diagnosis"])]
    dash = rollout_sections(logs, meta.get("batch"), label=label)
    if dash:
        lines += ["## The on-policy arms' rollouts", "", *dash]
    detail = []
    for arm, runs in by_arm.items():
        table, _, _ = comparison(runs, level="###", arm=label(arm))
        if table:
            detail += [f"## {label(arm)} against the control, view by view", "", *table]
    lines += detail
    return "\n".join(lines).rstrip() + "\n"
