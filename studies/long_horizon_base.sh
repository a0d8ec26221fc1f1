#!/usr/bin/env bash
# The long-horizon family's base run and its pinned SFT student, shared by studies/long_horizon_sweep.sh and
# studies/opd_ablation.sh (sourced by them, from the repository root, on a throwaway branch):
# 1. the whole pipeline on the family (the models stage trains the teacher on it), with FRESH rows of the
#    train split held back for a fresh control (control.fresh_rows), committed;
# 2. its SFT student pinned (paths.distill_init) as the one start of every arm.
# Skipped when the pinned student's .dvc file is already there. Sets INIT and BASE for the caller.
# BASE_UNTIL=sft stops the base run at the sft stage (its student is all the arms take from it); unset, the
# base run is the whole pipeline, as studies/long_horizon_sweep.sh made reports/distillation.md.
FRESH="${FRESH:-4800}"             # rows held back for the fresh control (it draws STEPS x BATCH: 2 epochs)
TEACHER_STEPS="${TEACHER_STEPS:-2000}"
INIT=data/study/long_horizon_sft_init
BASE=(
  -S 'synthetic.tasks=[running_sum,shift_steps]'
  -S "models.teacher_training.steps=$TEACHER_STEPS"
  -S "data.subset_size=$((2200 + FRESH))" -S "control.fresh_rows=$FRESH"
  -S teacher_gen.max_tokens=64 -S opd.max_new_tokens=64 -S evaluate.max_new_tokens=64
  -S "opd.steps=$STEPS" -S "opd.global_batch_size=$BATCH" -S opd.snapshot_every=50
)
if [ ! -f "$INIT.dvc" ]; then
  # shellcheck disable=SC2086
  dvc exp run "${BASE[@]}" -n long-horizon-base ${BASE_UNTIL:-}   # writes params.yaml in the workspace
  dvc exp apply long-horizon-base 2>/dev/null || true
  mkdir -p data/study && rm -rf "$INIT"
  cp -r data/sft/model "$INIT" && rm -rf "$INIT/snapshots"
  dvc add -q "$INIT"
  git add params.yaml dvc.lock "$INIT.dvc" data/study/.gitignore
  git commit -qm "long-horizon study: the base run and the fixed SFT start of every arm"
fi
