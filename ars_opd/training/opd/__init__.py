"""On-policy distillation, the OPD side of the training engine, one module per part:

- ``stage``: the opd stage (``run_opd``) and what each worker prepares before step 0 (``prepare_opd``);
- ``task``: ``OPDTask``, a step's rollouts (or the teacher's text) scored by the teacher, the objective, the
  step's columns and the rollouts' live health check;
- ``data``: the rows a run trains on (``OPDData``, ``encode_rows``);
- ``anchor``: the teacher's text trained beside the rollouts (``opd.anchor``);
- ``teachers`` and ``teacher_setup``: the teacher that scores, local or behind an endpoint, built and checked;
- ``cross_teacher``: a teacher that scores the student's text in its own tokens (``opd.cross_tokenizer``);
- ``rollout_health``: the detector of rollouts that stopped ending (plain Python: the report, ``ars-opd summary``
  and ``ars-opd check`` read it too).

The budget's FLOPs accounting (``ars_opd.training.budget``) and the data cost (``ars_opd.training.data_cost``) stay
with the engine: SFT, the control arm and the evaluation read them too. Nothing is imported here, so a module that
needs one part (the report needs ``rollout_health``) loads that part alone.
"""
