#!/usr/bin/env bash
# Why OPD falls below its own start on the long-horizon family: one factor changed per arm, each arm run for OPD
# and for its continued-SFT control at the same settings (the control runs OPD's loop: steps, batch and the
# learning-rate schedule), from the same pinned SFT student (studies/long_horizon_base.sh), paired by training
# seed. Run from a clean checkout on a throwaway branch:
#     git switch -c opd-ablation && bash studies/opd_ablation.sh
# then `ars-opd distillation` (printed at the end) writes reports/opd_ablation.md.
#
# Arms (ARMS picks a subset; each one dvc experiment per seed, named abl-<arm>-seed<seed>):
#   default     the study's setting: lr 1e-3, 10 warmup steps from zero (a re-warm: SFT ended at 3e-4 and the
#               optimizer state is fresh), cosine decay, rollouts at temperature 1, every step on-policy
#   lr1e-4      peak lr 1e-4, the same warmup and decay
#   lr3e-4      peak lr 3e-4, the same warmup and decay
#   norewarm    no re-warm: constant lr 3e-4 (SFT's final rate), no warmup, no decay
#   temp0.7     rollouts sampled at temperature 0.7 (the loss stays at opd.temperature 1)
#   lambda0.5   GKD's mixed λ: half the steps on the teacher's completions
#   fkl         forward KL (opd.beta 0) on the student's rollouts: reverse KL's gradient on a token the student
#               gives almost no mass is that mass times the log ratio, so a confidently wrong start barely
#               moves toward the teacher's token; forward KL pulls it there (p − q)
#   jsd0.5      generalised JSD at β 0.5, between the two
#   perseq      per-sequence normalisation (opd.loss_normalisation: sequence): every rollout weighs the same,
#               where the default's global token mean gives the longest (mostly wrong) rollouts the most weight
set -euo pipefail
# The study starts ~150 Python processes (dvc, each stage, its workers), each importing torch and transformers.
# .venv is installed without bytecode (Makefile: --no-compile), which is written on first import, unless
# PYTHONDONTWRITEBYTECODE is set, as in many containers: then every process compiles them again from source,
# ~8 s each here (the opd stage's imports: 13 s against 5.5 s). The Makefile unexports it for the same reason.
unset PYTHONDONTWRITEBYTECODE
# Every experiment scores the base student, the teacher, the seed's SFT student, the pinned start and, where dvc
# kept the control, the control's whole curve again: the evaluate stage stores each score under a hash of all it
# depends on and reads it back (ars_opd/evaluation/score_cache.py; the same files byte for byte)
export ARS_OPD_EVAL_CACHE="${ARS_OPD_EVAL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/ars-opd/eval-scores}"
SEEDS="${SEEDS:-1 2 3 4 5}"
STEPS="${STEPS:-300}"               # each arm's steps (the opd loop)
BATCH="${BATCH:-32}"                # each arm's global batch
# Arms that share the default's schedule first: the control (sft_continued) depends on OPD's loop alone (dvc.yaml),
# so within a seed it trains once for all six and dvc skips it for the next five (~45 s each)
ARMS="${ARMS:-default temp0.7 lambda0.5 fkl jsd0.5 perseq lr3e-4 lr1e-4 norewarm}"
# The base run stops at the pinned SFT student: its own OPD, control and evaluation at seed 0 (~3 min) are
# no arm's (every arm reruns them at its own settings and seed)
BASE_UNTIL="${BASE_UNTIL-sft}"
t0=$(date +%s)
source "$(dirname "$0")/long_horizon_base.sh"
echo "base: $(( $(date +%s) - t0 )) s" >&2
COMMON=(-S "paths.distill_init=$INIT" -S sft.steps=20 -S sft.warmup_steps=2 -S sft.snapshot_every=0
        -S evaluate.curve_examples=100 -S control.data=repeat -S "opd.steps=$STEPS" -S opd.snapshot_every=50)
# The overrides of an arm. Each states every knob any arm changes: `dvc exp run` in the workspace leaves the
# previous experiment's params applied, so a knob left out would carry over from the arm before.
arm_params() {
  case "$1" in
    default)   echo "-S opd.lr=0.001 -S opd.warmup_steps=10 -S opd.min_lr_ratio=0.1 -S opd.sample_temperature=1.0 -S opd.on_policy_fraction=1.0 -S opd.beta=1.0 -S opd.loss_normalisation=token" ;;
    lr1e-4)    echo "-S opd.lr=0.0001 -S opd.warmup_steps=10 -S opd.min_lr_ratio=0.1 -S opd.sample_temperature=1.0 -S opd.on_policy_fraction=1.0 -S opd.beta=1.0 -S opd.loss_normalisation=token" ;;
    lr3e-4)    echo "-S opd.lr=0.0003 -S opd.warmup_steps=10 -S opd.min_lr_ratio=0.1 -S opd.sample_temperature=1.0 -S opd.on_policy_fraction=1.0 -S opd.beta=1.0 -S opd.loss_normalisation=token" ;;
    norewarm)  echo "-S opd.lr=0.0003 -S opd.warmup_steps=0 -S opd.min_lr_ratio=1.0 -S opd.sample_temperature=1.0 -S opd.on_policy_fraction=1.0 -S opd.beta=1.0 -S opd.loss_normalisation=token" ;;
    temp0.7)   echo "-S opd.lr=0.001 -S opd.warmup_steps=10 -S opd.min_lr_ratio=0.1 -S opd.sample_temperature=0.7 -S opd.on_policy_fraction=1.0 -S opd.beta=1.0 -S opd.loss_normalisation=token" ;;
    lambda0.5) echo "-S opd.lr=0.001 -S opd.warmup_steps=10 -S opd.min_lr_ratio=0.1 -S opd.sample_temperature=1.0 -S opd.on_policy_fraction=0.5 -S opd.beta=1.0 -S opd.loss_normalisation=token" ;;
    fkl)       echo "-S opd.lr=0.001 -S opd.warmup_steps=10 -S opd.min_lr_ratio=0.1 -S opd.sample_temperature=1.0 -S opd.on_policy_fraction=1.0 -S opd.beta=0.0 -S opd.loss_normalisation=token" ;;
    jsd0.5)    echo "-S opd.lr=0.001 -S opd.warmup_steps=10 -S opd.min_lr_ratio=0.1 -S opd.sample_temperature=1.0 -S opd.on_policy_fraction=1.0 -S opd.beta=0.5 -S opd.loss_normalisation=token" ;;
    perseq)    echo "-S opd.lr=0.001 -S opd.warmup_steps=10 -S opd.min_lr_ratio=0.1 -S opd.sample_temperature=1.0 -S opd.on_policy_fraction=1.0 -S opd.beta=1.0 -S opd.loss_normalisation=sequence" ;;
    *) echo "unknown arm $1" >&2; exit 2 ;;
  esac
}
for seed in $SEEDS; do
  for arm in $ARMS; do
    # shellcheck disable=SC2046
    dvc exp run "${COMMON[@]}" $(arm_params "$arm") -S "ddp.seed=$seed" -n "abl-$arm-seed$seed"
    echo "seed $seed $arm: $(( $(date +%s) - t0 )) s" >&2
  done
done
dvc exp show --json --all-commits > /tmp/opd_ablation_exps.json
echo "study: $(( $(date +%s) - t0 )) s; now: python studies/opd_ablation_report.py /tmp/opd_ablation_exps.json" >&2
