#!/usr/bin/env bash
# Where OPD should win: the equal-budget study on the long-horizon task family (answers of 20-60 tokens
# written step by step; ars_opd/data/synthetic.py). Run from a clean checkout on a throwaway branch:
#     git switch -c long-horizon-study && bash studies/long_horizon_sweep.sh
# then copy reports/distillation.md and reports/distillation/long_horizon/ to your branch.
#
# 1-2. The base run and its pinned SFT student (studies/long_horizon_base.sh, shared with studies/opd_ablation.sh).
# 3. Per training seed (ddp.seed), two experiments in the workspace: the control repeating the SFT stage's
#    rows (repeat) and the control on the held-back rows (fresh: new prompts, two epochs over them). OPD is the same run in both (DVC's run cache
#    restores it for the second), so each seed's OPD is compared with both controls.
# 4. `ars-opd distillation --family long-horizon` writes the family's section of reports/distillation.md.
set -euo pipefail
SEEDS="${SEEDS:-1 2 3 4 5}"
STEPS="${STEPS:-300}"               # each arm's steps (the opd loop)
BATCH="${BATCH:-32}"                # each arm's global batch
t0=$(date +%s)
source "$(dirname "$0")/long_horizon_base.sh"
echo "base: $(( $(date +%s) - t0 )) s" >&2
COMMON=(-S "paths.distill_init=$INIT" -S sft.steps=20 -S sft.warmup_steps=2 -S sft.snapshot_every=0
        -S evaluate.curve_examples=100)
for seed in $SEEDS; do
  dvc exp run "${COMMON[@]}" -S "ddp.seed=$seed" -S control.data=repeat -n "lh-repeat-seed$seed"
  dvc exp run "${COMMON[@]}" -S "ddp.seed=$seed" -S control.data=fresh -n "lh-fresh-seed$seed"
  echo "seed $seed: $(( $(date +%s) - t0 )) s" >&2
done
dvc exp show --json --all-commits > /tmp/long_horizon_exps.json
{ echo "git switch -c long-horizon-study && bash studies/long_horizon_sweep.sh   # SEEDS=\"$SEEDS\" STEPS=$STEPS BATCH=$BATCH"
  echo "# base run: ${BASE[*]}"
  echo "# every experiment: ${COMMON[*]} -S ddp.seed=<seed>"
  echo "# main study: -S control.data=repeat; fresh-control regime: -S control.data=fresh"
  echo "dvc exp show --json --all-commits > exps.json"
  echo "ars-opd distillation --from exps.json --out reports/distillation.md --family long-horizon \\"
  echo "  --where paths.distill_init=$INIT --where control.data=repeat \\"
  echo "  --regime 'fresh control (new prompts, each once):paths.distill_init=$INIT,control.data=fresh'"
} > /tmp/long_horizon_commands.txt
ars-opd distillation --from /tmp/long_horizon_exps.json --commands /tmp/long_horizon_commands.txt \
  --out reports/distillation.md --family long-horizon \
  --where "paths.distill_init=$INIT" --where control.data=repeat \
  --regime "fresh control (new prompts, each once):paths.distill_init=$INIT,control.data=fresh"
echo "study: $(( $(date +%s) - t0 )) s" >&2
