"""The ``report`` stage: a report readable in a minute — did distillation work, were the workers consistent.

Reads the per-step logs of the training stages (``steps.jsonl``, with pandas) and the evaluation metrics,
and writes: ``report.md`` (metric definitions, a summary table per stage, the evaluation table, the
silent-inconsistency rule and the steps it flags), PNG figures, per-step CSV series for ``dvc plots``, and
a flat metrics JSON for ``dvc exp show``.

Silent inconsistency (our rule, stated in the report): a step is flagged when some dispersion statistic —
loss dispersion, gradient-norm dispersion, or 1 − direction consistency — is far above its own recent
baseline while the global loss moves normally. Baselines are the median and the scaled MAD over the
previous ``window`` steps (no look-ahead); "far above" means above median + k·max(MAD, 5%·median) *and*
more than ``ratio`` × median; "moves normally" means the step's |Δ global loss| is within the same kind of
bound computed on the loss changes. A step needs window/2 earlier values (and loss changes) to be judged.

Pure functions (``silent_steps``, ``summarise``) do the arithmetic; ``write_report`` does the I/O.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from ars_opd.artifacts import atomic_outputs, read_jsonl, write_json
from ars_opd.config import PathsConfig, ReportConfig
from ars_opd.evaluation.tables import render_table

STAGES = ("sft", "opd")
DISPERSION = {
    "loss_dispersion": "consistency/loss_dispersion",
    "grad_norm_dispersion": "consistency/grad_norm_dispersion",
    "direction_inconsistency": None,  # 1 - consistency/grad_direction_consistency
}
SUMMARY_COLUMNS = {
    "loss": "global loss",
    "consistency/loss_dispersion": "loss dispersion (std)",
    "consistency/loss_range": "loss range",
    "consistency/grad_norm_dispersion": "grad-norm dispersion (std)",
    "consistency/grad_direction_consistency": "direction consistency (mean pairwise cos)",
    "consistency/gradient_diversity": "gradient diversity",
    "grad_norm": "grad norm of the reduced gradient (pre-clip)",
}

DEFINITIONS = """\
Step t, K workers. L_k: worker k's token-mean loss on its share of the step. g_k: worker k's local
gradient, summed over its accumulation micro-batches, taken before the all-reduce, in the scale of the
reduced gradient ḡ = mean_k g_k (each worker's loss is scaled by K / N_global tokens).

| statistic | definition |
|---|---|
| loss dispersion | population std over k of L_k; loss range: max_k L_k − min_k L_k |
| gradient-norm dispersion | population std over k of ‖g_k‖₂ |
| direction consistency | mean over pairs i<j of cos(g_i, g_j) (exact for K = 2; for K > 2 exact every `gram_every` steps, else a norm-weighted estimate with a logged error bound) |
| cos to mean | cos(g_k, ḡ) per worker |
| gradient diversity | Σ_k ‖g_k‖² / ‖Σ_k g_k‖² |

These follow the model card's words ("std / range of per-worker loss", "std of per-worker gradient L2
norms", "average cosine similarity between worker gradients"); the exact equations of arXiv 2602.14462 were
not recoverable, so these are ours.
"""


def load_steps(path: Path) -> pd.DataFrame:
    """A stage's per-step log as a DataFrame (one row per step); empty if the file is absent."""
    if not path.exists():
        return pd.DataFrame()
    return pd.DataFrame(read_jsonl(path))


def min_baseline(window: int) -> int:
    """Finite earlier values a step needs before it is judged."""
    return max(2, window // 2)


def _rolling_bound(x: pd.Series, window: int, k: float) -> tuple[pd.Series, pd.Series]:
    """For each step i: median and scaled MAD of the finite values among x[i-window:i] (no look-ahead),
    NaN while fewer than ``min_baseline(window)`` are there. The MAD is that of the window itself, about
    the window's own median (a rolling median of deviations from earlier medians is not, and doubled the
    threshold on a trend)."""
    v = x.to_numpy(dtype=float)
    med, mad = np.full(len(v), np.nan), np.full(len(v), np.nan)
    need = min_baseline(window)
    for i in range(len(v)):
        w = v[max(0, i - window):i]
        w = w[np.isfinite(w)]
        if len(w) >= need:
            med[i] = np.median(w)
            mad[i] = 1.4826 * np.median(np.abs(w - med[i]))
    med_s = pd.Series(med, index=x.index)
    return med_s, med_s + k * np.maximum(pd.Series(mad, index=x.index), 0.05 * med_s.abs())


def silent_steps(df: pd.DataFrame, window: int = 50, k: float = 4.0, ratio: float = 2.0) -> pd.DataFrame:
    """Flag steps whose dispersion is far above its trailing baseline while the global loss moves normally.

    Returns one row per flagged step: step, statistic, value, baseline (median), loss_change.
    """
    cols = {"step": [], "statistic": [], "value": [], "baseline": [], "loss_change": []}
    if df.empty or "consistency/loss_dispersion" not in df:
        return pd.DataFrame(cols)
    dloss = df["loss"].diff().abs()
    _, loss_hi = _rolling_bound(dloss, window, k)
    loss_normal = dloss <= loss_hi
    series = {
        "loss_dispersion": df["consistency/loss_dispersion"],
        "grad_norm_dispersion": df["consistency/grad_norm_dispersion"],
        "direction_inconsistency": 1.0 - df["consistency/grad_direction_consistency"],
    }
    for name, x in series.items():
        x = x.astype(float)
        if x.isna().all():
            continue
        med, hi = _rolling_bound(x, window, k)
        flagged = (x > hi) & (x > ratio * med) & loss_normal
        for i in np.flatnonzero(flagged.fillna(False).to_numpy()):
            cols["step"].append(int(df["step"].iloc[i]))
            cols["statistic"].append(name)
            cols["value"].append(float(x.iloc[i]))
            cols["baseline"].append(float(med.iloc[i]))
            cols["loss_change"].append(float(dloss.iloc[i]))
    return pd.DataFrame(cols).sort_values(["step", "statistic"]).reset_index(drop=True)


def loss_spikes(df: pd.DataFrame, window: int = 50, k: float = 4.0) -> int:
    """Steps whose |Δ global loss| exceeds its trailing bound: how (un)smooth the averaged loss curve is."""
    if df.empty or len(df) < 3:
        return 0
    dloss = df["loss"].diff().abs()
    _, hi = _rolling_bound(dloss, window, k)
    return int((dloss > hi).sum())


def summarise(df: pd.DataFrame) -> dict[str, dict[str, float]]:
    """mean, p95 and max of each summary column present."""
    out = {}
    for col in SUMMARY_COLUMNS:
        if col in df and df[col].notna().any():
            x = df[col].astype(float).dropna()
            out[col] = {"mean": float(x.mean()), "p95": float(x.quantile(0.95)), "max": float(x.max())}
    return out


def _fmt(v) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "n/a"
    return f"{v:.4g}"


def _figure(df: pd.DataFrame, flagged: pd.DataFrame, stage: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    ax = axes[0, 0]
    if "worker_loss" in df:
        per = np.array(df["worker_loss"].tolist(), dtype=float)
        for k in range(per.shape[1]):
            ax.plot(df["step"], per[:, k], lw=0.6, alpha=0.6, label=f"worker {k}")
    ax.plot(df["step"], df["loss"], color="black", lw=1.2, label="global (all tokens)")
    ax.set_title(f"{stage}: global loss and per-worker losses")
    ax.legend(fontsize=7)
    for ax, col, title in ((axes[0, 1], "consistency/loss_dispersion", "loss dispersion (std over workers)"),
                           (axes[1, 0], "consistency/grad_norm_dispersion", "gradient-norm dispersion"),
                           (axes[1, 1], "consistency/grad_direction_consistency", "direction consistency (cos)")):
        if col in df:
            ax.plot(df["step"], df[col], lw=0.8)
            name = {"consistency/loss_dispersion": "loss_dispersion",
                    "consistency/grad_norm_dispersion": "grad_norm_dispersion",
                    "consistency/grad_direction_consistency": "direction_inconsistency"}[col]
            hits = flagged[flagged["statistic"] == name]["step"] if not flagged.empty else []
            if len(hits):
                ys = df.set_index("step").loc[hits, col]
                ax.scatter(hits, ys, color="red", s=12, zorder=3, label="silent step")
                ax.legend(fontsize=7)
        ax.set_title(title)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def build_report(stage_logs: dict[str, pd.DataFrame], eval_metrics: dict | None, cfg: ReportConfig) -> tuple[str, dict, dict]:
    """(markdown, flat metrics, flagged steps per stage) from the loaded logs."""
    md = ["# ars-opd report", ""]
    flat: dict = {}
    flagged_all: dict[str, pd.DataFrame] = {}
    if eval_metrics:
        md += ["## Did distillation work?", "", render_table(eval_metrics)]
        for model in ("base", "sft", "opd", "teacher"):
            m = eval_metrics.get(model) or {}
            for key in ("exact_match", "reverse_kl", "teacher_nll"):
                if m.get(key) is not None:
                    flat[f"eval/{model}/{key}"] = m[key]
        sft, opd = eval_metrics.get("sft") or {}, eval_metrics.get("opd") or {}
        if sft and opd:
            verdict = ("lower" if opd["reverse_kl"] < sft["reverse_kl"] else "not lower")
            md += [f"OPD's reverse KL to the teacher on its own samples is **{verdict}** than SFT's "
                   f"({opd['reverse_kl']:.4f} vs {sft['reverse_kl']:.4f} per token).", ""]
    md += ["## Worker consistency", "", DEFINITIONS, ""]
    md += ["### Silent-inconsistency rule", "",
           f"A step is flagged when loss dispersion, gradient-norm dispersion or 1 − direction consistency exceeds "
           f"both median + {cfg.k}·max(MAD, 5% of median) and {cfg.ratio}× median of the previous {cfg.window} "
           f"steps, while the step's |Δ global loss| stays within the same bound computed on the loss changes "
           f"(so the averaged loss curve shows nothing). A step is judged once {min_baseline(cfg.window)} earlier "
           f"steps (and loss changes) exist, so steps 0–{min_baseline(cfg.window)} are not judged.", ""]
    for stage, df in stage_logs.items():
        if df.empty:
            continue
        workers = len(df["worker_loss"].iloc[0]) if "worker_loss" in df else 1
        scenario = df["scenario"].iloc[0] if "scenario" in df else "n/a"
        flagged = silent_steps(df, cfg.window, cfg.k, cfg.ratio)
        flagged_all[stage] = flagged
        summary = summarise(df)
        md += [f"### {stage}: {len(df)} steps, {workers} workers, scenario {scenario}", "",
               "| statistic | mean | p95 | max |", "|---|---|---|---|"]
        for col, s in summary.items():
            md.append(f"| {SUMMARY_COLUMNS[col]} | {_fmt(s['mean'])} | {_fmt(s['p95'])} | {_fmt(s['max'])} |")
            flat[f"{stage}/{col.split('/')[-1]}_mean"] = s["mean"]
        md += ["", f"![{stage}](figures/{stage}.png)", ""]
        if flagged.empty:
            md += [f"No silent steps flagged in {stage}.", ""]
        else:
            md += [f"{len(flagged['step'].unique())} silent step(s) flagged in {stage}:", "",
                   "| step | statistic | value | baseline (median) | abs. loss change |", "|---|---|---|---|---|"]
            for _, r in flagged.head(50).iterrows():
                md.append(f"| {r['step']} | {r['statistic']} | {_fmt(r['value'])} | {_fmt(r['baseline'])} | "
                          f"{_fmt(r['loss_change'])} |")
            md.append("")
        flat[f"{stage}/silent_steps"] = int(flagged["step"].nunique()) if not flagged.empty else 0
        flat[f"{stage}/loss_spikes"] = loss_spikes(df, cfg.window, cfg.k)
        md += [f"Global-loss spikes in {stage} (|Δ loss| beyond its own trailing bound): "
               f"{flat[f'{stage}/loss_spikes']} of {len(df)} steps.", ""]
        flat[f"{stage}/final_loss"] = float(df["loss"].iloc[-1])
    return "\n".join(md) + "\n", flat, flagged_all


PLOT_COLUMNS = ("step", "loss", "consistency/loss_dispersion", "consistency/grad_norm_dispersion",
                "consistency/grad_direction_consistency", "grad_norm")


def write_report(cfg: ReportConfig, paths: PathsConfig) -> dict:
    """Run the stage: read logs and evaluation, write report.md, figures, plot series and metrics."""
    logs = {s: load_steps(Path(paths.training(s).steps)) for s in STAGES}
    if all(df.empty for df in logs.values()):
        where = ", ".join(paths.training(s).steps for s in STAGES)
        raise FileNotFoundError(f"no training log found ({where}): run sft/opd first")
    eval_path = Path(paths.eval_metrics)
    eval_metrics = json.loads(eval_path.read_text()) if eval_path.exists() else None
    md, flat, flagged = build_report(logs, eval_metrics, cfg)
    with atomic_outputs(paths.report_md, paths.report_figures, paths.report_plots, paths.report_metrics) as tmp:
        tmp[0].write_text(md)
        tmp[1].mkdir(parents=True)
        tmp[2].mkdir(parents=True)
        for stage, df in logs.items():
            if df.empty:
                continue
            _figure(df, flagged.get(stage, pd.DataFrame()), stage, tmp[1] / f"{stage}.png")
            cols = [c for c in PLOT_COLUMNS if c in df]
            out = df[cols].rename(columns=lambda c: c.split("/")[-1])
            out.to_csv(tmp[2] / f"{stage}.csv", index=False)
        write_json(tmp[3], flat)
    return flat
