"""Reading DVC experiments: ``dvc exp show --json`` output walked revision by revision (``walk_experiments``),
or fetched from the repository (``exp_show_json``). Used by the studies that turn a sweep of experiments into
a report (``ars_opd.evaluation.scenarios``, ``ars_opd.evaluation.distillation``)."""

from __future__ import annotations

import json
import subprocess
from typing import Any


def walk_experiments(data: Any):
    """Yield (name, params, metrics, is_experiment, rev) for every revision in `dvc exp show --json` output
    (rev: the experiment's commit, a baseline commit, or "workspace")."""
    queue = list(data if isinstance(data, list) else [data])
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
        yield exp.get("name") or exp.get("rev"), params, metrics, bool(exp.get("_experiment")), exp.get("rev")


def exp_show_json(cwd: str = ".") -> Any:
    out = subprocess.run(
        ["dvc", "exp", "show", "--json", "--all-commits"], cwd=cwd, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout)
