"""Why on-policy distillation's rollouts stop ending: the measurements behind the diagnosis in
``reports/pruned_recovery.md``, on the real profile's start (the SFT'd pruned SmolLM2 student and its teacher).

Three measurements, each one JSON line (``--out``, default ``reports/opd_collapse.jsonl``):

- ``eos_rates``: the teacher's and the start's own EOS rate on training prompts, greedy and sampled at
  temperature 1, at ``max_new_tokens`` 48 and 128: does the teacher itself end within the rollouts' budget?
- ``eos_gradient``: on the start's own rollouts (temperature 1, 48 tokens), the gradient of each position's
  divergence with respect to the end token's logit, for β = 1 (reverse KL), 0.5 (JSD) and 0 (forward KL), at
  the positions where the student ended and the teacher would not (p_T(EOS) < 0.5), where the teacher would end
  (p_T(EOS) >= 0.5) and the student went on, and over all positions. Reported as the push on the EOS logit
  (minus the gradient: what one step of gradient descent moves it by, per unit of learning rate and before the
  optimiser's scaling), mean per position and summed per rollout. Reverse KL's push is q(EOS)·(log p − log q +
  D) (``ars_opd.lm.divergences``): it vanishes as the student's own q(EOS) does.
- ``bf16_teacher``: the teacher in bf16 (weights and autocast, as ``opd.teacher_dtype: auto`` and ``precision:
  auto`` give on CUDA) against fp32 on held-out rows: the NLL of the teacher's completions under each, and
  KL(fp32 teacher ‖ bf16 teacher) per token at those positions. This CPU's bf16 kernels are not CUDA's, so the
  figure bounds the effect of the dtype, not the GPU's own numbers.
- ``short_run`` (with ``--runs ROOT``): short OPD runs from the same start, one setting changed per arm
  (``studies/pruned_recovery.py --train-only``): each arm's EOS rate, length, student entropy, teacher log p and
  loss over its first and last steps, its EOS rate step by step, and the rollout-health verdict.
- ``precision_run`` (with ``--precision-runs LABEL=ROOT:ARM ...``): the same arm's runs under several precisions
  and devices, seed by seed (the GPU study's OPD in bf16 autocast with a bf16 teacher, the CPU study's in fp32, and
  the CPU study's start trained with ``opd.precision: bf16`` and ``opd.teacher_dtype: bf16``): the EOS rate of the
  first on-policy steps, the collapse step (the first from which no rollout ended for ``--collapse-span`` on-policy
  steps in a row), the steps with no rollout ended, the EOS rate over the last steps, the student's entropy and the
  teacher's log p at the start and the end, and the rollout-health verdict. Does the GPU's precision path collapse
  the rollouts where the device's kernels are not CUDA's?

With ``--skip-models`` the model measurements already in ``--out`` are kept, and so are its short runs or
precision runs when this call does not measure them again.

    python studies/opd_collapse.py --start build/pr-cpu/start --prompts 64 --heldout 100 --runs build/short-runs
    python studies/opd_collapse.py --start build/pr-cpu/start --skip-models \
        --precision-runs "H200, bf16=reports/pruned_recovery_gpu/runs:opd" \
        "CPU, fp32=reports/pruned_recovery/runs:opd" "CPU, bf16=reports/opd_collapse/bf16_runs:opd_bf16"
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ars_opd.artifacts import read_jsonl  # noqa: E402
from ars_opd.data.prompts import encode_prompts, encode_teacher_completions  # noqa: E402
from ars_opd.lm.batching import build_rollout_batch, pad_right_with_labels, pad_token_id  # noqa: E402
from ars_opd.lm.cross_entropy import shifted_targets  # noqa: E402
from ars_opd.lm.divergences import divergence_terms  # noqa: E402
from ars_opd.lm.generation import eos_token_ids, generate_token_ids  # noqa: E402
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows  # noqa: E402
from ars_opd.lm.optim import autocast_context  # noqa: E402
from ars_opd.models.loading import load_model, load_model_dir, load_tokenizer  # noqa: E402

BETAS = (1.0, 0.5, 0.0)


def eos_share(samples: list[list[int]], eos: tuple[int, ...]) -> float:
    return sum(any(t in eos for t in s) for s in samples) / len(samples)


def eos_rates(models: dict, tok, prompts, eos, batch: int) -> dict:
    out = {}
    for name, model in models.items():
        for new in (48, 128):
            for sample in (False, True):
                torch.manual_seed(0)
                got = generate_token_ids(
                    model,
                    tok,
                    prompts,
                    new,
                    batch_size=batch,
                    do_sample=sample,
                    temperature=1.0,
                    top_p=1.0,
                    eos_ids=eos,
                )
                out[f"{name}/{'sampled' if sample else 'greedy'}/{new}"] = eos_share(got, eos)
    return out


@torch.no_grad()
def eos_gradient(student, teacher, tok, prompts, eos, batch: int, chunk: int = 64) -> dict:
    """The push on the EOS logit of each β's divergence at the start's own rollouts (module docstring)."""
    torch.manual_seed(1)
    rollouts = generate_token_ids(
        student, tok, prompts, 48, batch_size=batch, do_sample=True, temperature=1.0, top_p=1.0, eos_ids=eos
    )
    vocab = len(tok)
    e = eos[0]
    pad = pad_token_id(tok)
    acc = {b: {"ends_teacher_would_not": [], "teacher_would_end": [], "all": [], "per_rollout": []} for b in BETAS}
    q_end, p_end = [], []
    for i in range(0, len(prompts), batch):
        b = build_rollout_batch(prompts[i : i + batch], rollouts[i : i + batch], pad, eos)
        mask, targets = b["loss_mask"], b["targets"][b["loss_mask"]]
        hs = select_rows(last_hidden_states(student, b["input_ids"], b["attention_mask"]), mask)
        ht = select_rows(last_hidden_states(teacher, b["input_ids"], b["attention_mask"]), mask)
        head_s, head_t = OutputHead.of(student, vocab), OutputHead.of(teacher, vocab)
        rows = mask.nonzero()[:, 0]
        for start in range(0, hs.shape[0], chunk):
            end = min(hs.shape[0], start + chunk)
            zs, zt = head_s.logits(hs[start:end]), head_t.logits(ht[start:end])
            q = torch.softmax(zs, -1)[:, e]
            p = torch.softmax(zt, -1)[:, e]
            y = targets[start:end]
            q_end += q[y == e].tolist()
            p_end += p[y == e].tolist()
            for beta in BETAS:
                _, grad = divergence_terms(lambda a, c, zt=zt: zt.clone(), beta)(zs.clone(), 0, end - start, True)
                push = (-grad[:, e]).double()  # what gradient descent moves the EOS logit by, per unit step
                ends = (y == e) & (p < 0.5)
                goes_on = (y != e) & (p >= 0.5)
                acc[beta]["ends_teacher_would_not"] += push[ends].tolist()
                acc[beta]["teacher_would_end"] += push[goes_on].tolist()
                acc[beta]["all"] += push.tolist()
                acc[beta]["row"] = acc[beta].get("row", []) + (rows[start:end] + i).tolist()
    out = {"rollouts": len(prompts), "student_eos_rate": eos_share(rollouts, eos)}
    out["mean q(EOS) where the student ended"] = sum(q_end) / max(1, len(q_end))
    out["mean p(EOS) where the student ended"] = sum(p_end) / max(1, len(p_end))
    for beta in BETAS:
        a = acc[beta]
        per_row: dict[int, float] = {}
        for r, v in zip(a["row"], a["all"]):
            per_row[r] = per_row.get(r, 0.0) + v
        summary = {}
        for k in ("ends_teacher_would_not", "teacher_would_end", "all"):
            v = a[k]
            summary[k] = {"positions": len(v), "mean_push": (sum(v) / len(v)) if v else None, "sum_push": sum(v)}
        summary["per_rollout_mean_push"] = sum(per_row.values()) / len(per_row)
        out[f"beta={beta}"] = summary
    return out


@torch.no_grad()
def bf16_teacher(teacher32, models_dir: Path, tok, rows: list[dict], batch: int) -> dict:
    teacher16 = load_model(models_dir, "teacher", dtype=torch.bfloat16).eval()
    prompts = encode_prompts(tok, [r["messages"] for r in rows])
    completions = encode_teacher_completions(tok, rows)
    pad, vocab = pad_token_id(tok), len(tok)
    nll32 = nll16 = kl = 0.0
    n = 0
    for i in range(0, len(prompts), batch):
        b = pad_right_with_labels(prompts[i : i + batch], completions[i : i + batch], pad)
        mask, targets = shifted_targets(b["labels"])
        h32 = select_rows(last_hidden_states(teacher32, b["input_ids"], b["attention_mask"]), mask)
        with autocast_context("bf16", torch.device("cpu")):  # the training path's precision: auto on CUDA
            h16 = select_rows(last_hidden_states(teacher16, b["input_ids"], b["attention_mask"]), mask)
            z16 = OutputHead.of(teacher16, vocab).logits(h16)  # bf16 product, upcast (as the chunked loss does)
        z32 = OutputHead.of(teacher32, vocab).logits(h32)
        l32, l16 = torch.log_softmax(z32.double(), -1), torch.log_softmax(z16.double(), -1)
        nll32 -= float(l32.gather(-1, targets[:, None]).sum())
        nll16 -= float(l16.gather(-1, targets[:, None]).sum())
        kl += float((l32.exp() * (l32 - l16)).sum())
        n += int(targets.numel())
    return {"rows": len(rows), "tokens": n, "nll_fp32": nll32 / n, "nll_bf16": nll16 / n, "kl_fp32_bf16": kl / n}


def _mean(part: list[dict], key: str) -> float | None:
    """The mean of ``key`` over the step-log rows ``part`` that hold a finite value of it; None if none does."""
    vals = [float(r[key]) for r in part if r.get(key) is not None and math.isfinite(float(r[key]))]
    return sum(vals) / len(vals) if vals else None


def short_runs(root: Path, baseline: int = 3) -> list[dict]:
    """Each short run's trajectory from its step log (``pruned_recovery.py --train-only`` arms under ``root``): the
    arm's overrides, and over its first ``baseline`` on-policy steps and its last as many: EOS rate, mean length,
    the student's entropy at its samples, the teacher's log p of them and the loss; the EOS rate step by step; the
    rollout-health verdict."""
    import yaml

    from ars_opd.training.opd.rollout_health import HealthConfig, detect

    out = []
    for steps in sorted(root.glob("seed-*/*/data/opd/log/steps.jsonl")):
        run = steps.parents[3]
        log = read_jsonl(steps)
        rows = [r for r in log if float(r.get("task/on_policy", 1.0)) >= 1.0]
        if not rows:
            continue
        opd = yaml.safe_load((run / "params.yaml").read_text()).get("opd", {})
        first, last = rows[:baseline], rows[-baseline:]
        line = {"arm": run.name, "seed": run.parent.name, "steps": len(rows)}
        line["opd"] = {k: opd[k] for k in OVERRIDE_KEYS if k in opd}
        for key in ("eos_rate", "response_length", "entropy", "teacher_logprob"):
            line[f"{key}_start"], line[f"{key}_end"] = _mean(first, f"task/{key}"), _mean(last, f"task/{key}")
        line["loss_start"], line["loss_end"] = _mean(first, "loss"), _mean(last, "loss")
        line["eos_by_step"] = [round(float(r["task/eos_rate"]), 3) for r in rows]
        alarm = detect(log, HealthConfig(), opd.get("global_batch_size")).alarm
        line["alarm"] = None if alarm is None else {"step": alarm.step, "kind": alarm.kind, "p": alarm.p}
        out.append(line)
    return out


def precision_runs(groups: list[tuple[str, Path, str]], span: int = 5, first: int = 6, ends: int = 12) -> list[dict]:
    """Seed by seed, how one arm's rollouts ended under each (label, root, arm) of ``groups``: the EOS rate of its
    ``first`` on-policy steps, its collapse step (the first on-policy step from which no rollout ended for ``span``
    on-policy steps in a row; None if none), how many on-policy steps ended no rollout, the EOS rate over its last
    ``ends`` on-policy steps, the student's entropy and the teacher's log p over its first three and last ``ends``
    on-policy steps (None where the log predates the column), and the rollout-health verdict."""
    import yaml

    from ars_opd.training.opd.rollout_health import HealthConfig, detect, rollouts_of
    from studies.rollout_health import collapse_step  # the calibration's own definition of a collapse

    out = []
    for label, root, arm in groups:
        logs = sorted(root.glob(f"seed-*/{arm}/data/opd/log/steps.jsonl"))
        if not logs:
            raise SystemExit(f"--precision-runs {label}: no seed-*/{arm}/data/opd/log/steps.jsonl under {root}")
        for steps in logs:
            run = steps.parents[3]
            log = read_jsonl(steps)
            opd = yaml.safe_load((run / "params.yaml").read_text()).get("opd", {})
            batch = opd.get("global_batch_size")
            rolls = rollouts_of(log, batch)
            rows = [r for r in log if r.get("task/eos_rate") is not None and float(r.get("task/on_policy", 1.0)) >= 1]
            line = {"group": label, "seed": run.parent.name, "arm": arm, "steps": len(rolls), "collapse_span": span}
            line["opd"] = {k: opd[k] for k in ("precision", "teacher_dtype", "lr", "max_new_tokens") if k in opd}
            line["eos_first"] = [round(s.ended / s.n, 3) for s in rolls[:first]]
            line["collapse_step"] = collapse_step(log, batch, span)
            line["steps_none_ended"] = sum(s.ended == 0 for s in rolls)
            tail = rolls[-ends:]
            line["eos_rate_end"] = sum(s.ended for s in tail) / sum(s.n for s in tail)
            for key in ("entropy", "teacher_logprob"):
                line[f"{key}_start"], line[f"{key}_end"] = (
                    _mean(rows[:3], f"task/{key}"),
                    _mean(rows[-ends:], f"task/{key}"),
                )
            alarm = detect(log, HealthConfig(), batch).alarm
            line["alarm"] = None if alarm is None else {"step": alarm.step, "kind": alarm.kind, "p": alarm.p}
            out.append(line)
    return out


def parse_groups(specs: list[str]) -> list[tuple[str, Path, str]]:
    """``LABEL=ROOT:ARM`` specs of ``--precision-runs``."""
    out = []
    for spec in specs:
        label, sep, rest = spec.partition("=")
        root, colon, arm = rest.rpartition(":")
        if not (sep and colon and label and root and arm):
            raise SystemExit(f"--precision-runs {spec!r}: expected LABEL=ROOT:ARM")
        out.append((label, Path(root), arm))
    return out


# the opd keys a short run's arm may change (what the diagnosis varies one at a time)
OVERRIDE_KEYS = (
    "lr",
    "beta",
    "on_policy_fraction",
    "sample_temperature",
    "max_new_tokens",
    "precision",
    "teacher_dtype",
    "teacher_temperature",
    "truncated_rollouts",
    "anchor",
    "loss",
)
MODEL_KINDS = ("eos_rates", "eos_gradient", "bf16_teacher")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", required=True, help="a study's start/ directory (its models and sft stages' outputs)")
    ap.add_argument("--prompts", type=int, default=64, help="training prompts for the EOS rates and gradients")
    ap.add_argument("--heldout", type=int, default=100, help="held-out rows for the bf16 teacher")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--out", default="reports/opd_collapse.jsonl")
    ap.add_argument("--runs", help="a --train-only study root whose short runs' trajectories are summarised too")
    ap.add_argument(
        "--precision-runs",
        nargs="+",
        default=[],
        metavar="LABEL=ROOT:ARM",
        help="one arm's runs under several precisions or devices, seed by seed (the module docstring)",
    )
    ap.add_argument("--note", help="how runs measured here were made, kept in the meta line (after a kept note)")
    ap.add_argument("--collapse-span", type=int, default=5, help="on-policy steps with no rollout ended = collapsed")
    ap.add_argument(
        "--skip-models",
        action="store_true",
        help="keep --out's model measurements (and its short or precision runs where this call measures none)",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    start, out = Path(args.start), Path(args.out)
    t0 = time.perf_counter()
    groups = parse_groups(args.precision_runs)
    previous = read_jsonl(out) if out.is_file() else []
    if args.skip_models:
        kept = {*MODEL_KINDS, *(() if args.runs else ("short_run",)), *(() if groups else ("precision_run",))}
        lines = [x for x in previous if x["kind"] in kept]
    else:
        models_dir = start / "data" / "models"
        tok = load_tokenizer(models_dir)
        teacher = load_model(models_dir, "teacher").eval()
        student = load_model_dir(start / "data" / "sft" / "model", stage="sft").eval()
        eos = eos_token_ids(student, tok)
        train = read_jsonl(start / "data" / "teacher" / "train.jsonl")[: args.prompts]
        prompts = encode_prompts(tok, [r["messages"] for r in train])
        models = {"teacher": teacher, "start": student}
        lines = [{"kind": "eos_rates", **eos_rates(models, tok, prompts, eos, args.batch)}]
        lines.append({"kind": "eos_gradient", **eos_gradient(student, teacher, tok, prompts, eos, args.batch)})
        held = read_jsonl(start / "data" / "teacher" / "eval.jsonl")[: args.heldout]
        lines.append({"kind": "bf16_teacher", **bf16_teacher(teacher, models_dir, tok, held, args.batch)})
    if args.runs:
        lines += [{"kind": "short_run", **x} for x in short_runs(Path(args.runs))]
    if groups:
        lines += [{"kind": "precision_run", **x} for x in precision_runs(groups, args.collapse_span)]
    seconds = round(time.perf_counter() - t0, 1)
    meta = {"kind": "meta", "start": str(start), "runs": args.runs, "seconds": seconds, "torch": torch.__version__}
    if groups:
        meta["precision_runs"] = args.precision_runs
    if args.skip_models:  # what the kept lines' own call recorded (its runs, its note) stays with them
        old = next((x for x in previous if x["kind"] == "meta"), {})
        meta = {
            **{k: v for k, v in old.items() if k not in ("seconds", "torch")},
            **{k: v for k, v in meta.items() if v is not None},
        }
    if args.note:
        meta["note"] = f"{meta['note']}; {args.note}" if meta.get("note") else args.note
    lines.append(meta)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    for x in lines:
        print(json.dumps(x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
