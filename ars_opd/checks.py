"""``ars-opd check``: validate every stage's outputs so CI can gate on them.

For each stage: the files it promises exist; JSON and JSON Lines parse (a truncated or torn line is named
with its file and line); rows have their schema; counts agree across stages (subset → teacher completions
+ failures → training data, whose manifest accounts for every row: kept, or dropped for a named reason such
as ``dropped_teacher_truncated``); training logs have one row per step with finite values; every metric is a
finite number within its range (accuracies and fractions in [0, 1], losses and divergences >= 0); the
pinned models and a local data source still match the hashes their stages recorded; a run with engine rollouts
held every sync and every lag-0 step within its tolerance and told every version from the previous one
(``ars_opd.rollouts.version_log``); a run whose rollouts left their start (stopped ending, grew longer or
shorter: ``ars_opd.training.opd.rollout_health``) is a problem, named in one line.
Returns the problems as "path: what is wrong" lines; none means the outputs are sound.

What it leaves out: judging quality (a weak teacher passes; the models stage has its own accuracy gate), beyond
the rollouts' health: a distillation whose samples stopped ending trained on nothing a user wants.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

from ars_opd.artifacts import JsonlLineError, file_sha256, files_sha256, iter_jsonl
from ars_opd.config import TRAINING_STAGES, PathsConfig

STAGES = ("models", "subset", "teacher_gen", *TRAINING_STAGES, "evaluate", "report")


class Problems(list):
    def add(self, where: Any, message: str) -> None:
        self.append(f"{where}: {message}")


def _read_json(path: Path, problems: Problems) -> Any:
    if not path.is_file():
        problems.add(path, "missing")
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        problems.add(path, f"not valid JSON ({e.msg} at line {e.lineno})")
        return None


def _read_jsonl(path: Path, problems: Problems, required: tuple[str, ...] = ()) -> list[dict] | None:
    if not path.is_file():
        problems.add(path, "missing")
        return None
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        problems.add(path, "last line has no newline: truncated write?")
    rows = []
    for i, row in iter_jsonl(data):
        if isinstance(row, JsonlLineError):
            problems.add(f"{path}:{i}", row.message)
            continue
        if not isinstance(row, dict):
            problems.add(f"{path}:{i}", f"not a JSON object ({type(row).__name__})")
            continue
        missing = [k for k in required if k not in row]
        if missing:
            problems.add(f"{path}:{i}", f"missing keys {missing}")
        rows.append(row)
    return rows


def _finite_numbers(obj: Any, where: str, problems: Problems, rules: dict[str, Callable[[float], bool]]) -> None:
    """Every number in a (nested) metrics object is finite, and within range where a rule names its key."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            _finite_numbers(v, f"{where}.{k}" if where else k, problems, rules)
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            _finite_numbers(v, f"{where}[{i}]", problems, rules)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        if not math.isfinite(obj):
            problems.add(where, f"not finite ({obj})")
            return
        leaf = where.split(".")[-1].split("/")[-1]
        for key, ok in rules.items():
            if key in leaf and not ok(obj):
                problems.add(where, f"out of range ({obj}) for {key}")


RULES: dict[str, Callable[[float], bool]] = {
    "exact_match": lambda v: 0.0 <= v <= 1.0,
    "accuracy": lambda v: 0.0 <= v <= 1.0,  # the long-horizon step and prefix accuracies
    "fraction": lambda v: 0.0 <= v <= 1.0,
    "reverse_kl": lambda v: v >= -1e-6,
    "nll": lambda v: v >= 0.0,
    "loss": lambda v: v >= -1e-6,
    "tokens_per_s": lambda v: v > 0,
    "steps": lambda v: v >= 0,
}


def _metrics(path: Path, problems: Problems) -> dict | None:
    m = _read_json(path, problems)
    if m is not None:
        rules = RULES
        if isinstance(m, dict) and m.get("reverse_kl_kind") == "sampled_cross_tokenizer":
            # across tokenizers reverse KL is a sampled estimate, log q - log p of each sample: a mean of such
            # terms may be below 0 (its expectation is not), so only finiteness is checked
            rules = {k: v for k, v in RULES.items() if k != "reverse_kl"}
        _finite_numbers(m, str(path), problems, rules)
    return m


def check_models(p: PathsConfig, problems: Problems) -> None:
    d = Path(p.models_dir)
    manifest = _read_json(d / "manifest.json", problems)
    if manifest:
        for role in ("teacher", "student", "tokenizer"):
            if role not in manifest:
                problems.add(d / "manifest.json", f"no '{role}' entry")
        for role in ("teacher", "student"):
            ref = manifest.get(role) or {}
            if ref.get("source") == "builtin" and not (d / role / "model.safetensors").is_file():
                problems.add(d / role, "built-in model weights missing")
            elif ref:
                _check_pin(d, role, ref, problems)
        if manifest.get("student_source"):  # the model a student was pruned from, when not the teacher
            _check_pin(d, "student_source", manifest["student_source"], problems)
        for name, entry in (manifest.get("teachers") or {}).items():  # several teachers: every one's pin
            _check_named_teacher(d, name, entry, problems)
        if manifest.get("cross_tokenizer"):
            _check_teacher_tokenizer(d, manifest.get("teacher_tokenizer"), problems)
    if not (d / "tokenizer" / "tokenizer_config.json").is_file():
        problems.add(d / "tokenizer", "tokenizer missing")
    _metrics(Path(p.models_metrics), problems)


def _check_teacher_tokenizer(models_dir: Path, entry: dict | None, problems: Problems) -> None:
    """With opd.cross_tokenizer the teacher's own tokenizer is saved apart and pinned: present, and its files still
    those the manifest hashed (the OPD stage tokenises the teacher's side with it)."""
    from ars_opd.models.loading import ModelSourceError, sha256_of_files  # torch: only for this check

    where = models_dir / "teacher_tokenizer"
    if not entry:
        problems.add(models_dir / "manifest.json", "cross_tokenizer is on but there is no 'teacher_tokenizer' entry")
        return
    if not (where / "tokenizer_config.json").is_file():
        problems.add(where, "teacher tokenizer missing")
        return
    try:
        digest = sha256_of_files(where)
    except ModelSourceError as e:
        problems.add(where, str(e))
        return
    if digest != entry.get("sha256"):
        problems.add(where, f"changed after the models stage pinned it (sha256 {digest[:12]}… now)")


def _check_pin(models_dir: Path, role: str, ref: dict, problems: Problems) -> None:
    """The files of a pinned model still match the manifest (what every stage checks before loading it)."""
    from ars_opd.models.loading import ModelSourceError, verify_pin  # torch: only for this check

    try:
        verify_pin(models_dir, role, ref)
    except ModelSourceError as e:
        problems.add(models_dir / "manifest.json", f"{role}: {e}")


def _check_named_teacher(models_dir: Path, name: str, entry: dict, problems: Problems) -> None:
    """A named teacher (``teachers.named``) still matches its pin; an endpoint teacher has none, only its URL."""
    from ars_opd.models.loading import ModelSourceError  # torch: only for this check
    from ars_opd.models.teachers import teacher_path

    if entry.get("source") == "endpoint":
        if not entry.get("url") or not entry.get("model"):
            problems.add(models_dir / "manifest.json", f"teachers.{name}: an endpoint teacher without a URL or model")
        return
    try:
        teacher_path(models_dir, name, entry)
    except (ModelSourceError, KeyError) as e:
        problems.add(models_dir / "manifest.json", f"teachers.{name}: {e}")


def _check_source(stats: dict, where: str, problems: Problems) -> None:
    """A local data source still has the sha256 the subset stage recorded."""
    pinned, source = stats.get("source_sha256"), Path(str(stats.get("source", ""))).expanduser()
    if not pinned:
        return
    if not source.exists():
        problems.add(where, f"the data source {source} the subset was made from is gone")
        return
    now = file_sha256(source) if source.is_file() else files_sha256(source, None)[0]
    if now != pinned:
        problems.add(
            where,
            f"the data source {source} changed after the subset stage read it (sha256 "
            f"{pinned[:12]}… then, {now[:12]}… now): run `dvc repro`",
        )


SUBSET_KEYS = ("id", "messages", "reference", "task")


def check_subset(p: PathsConfig, problems: Problems) -> dict[str, list[dict]]:
    out = {}
    stats = _read_json(Path(p.subset_stats), problems)
    if stats:
        _check_source(stats, p.subset_stats, problems)
    for split, path in (("train", p.subset_train), ("eval", p.subset_eval)):
        rows = _read_jsonl(Path(path), problems, SUBSET_KEYS)
        if rows is None:
            continue
        out[split] = rows
        for i, r in enumerate(rows, 1):
            msgs = r.get("messages")
            if (
                not isinstance(msgs, list)
                or not msgs
                or not all(
                    isinstance(m, dict)
                    and m.get("role") in ("system", "user", "assistant")
                    and isinstance(m.get("content"), str)
                    for m in msgs
                )
            ):
                problems.add(f"{path}:{i}", "messages are not a list of {role, content}")
        if stats and stats.get(split) != len(rows):
            problems.add(path, f"{len(rows)} rows but stats.json says {stats.get(split)}")
    _metrics(Path(p.subset_metrics), problems)
    return out


def check_teacher(p: PathsConfig, problems: Problems, subset: dict[str, list[dict]]) -> None:
    d = Path(p.teacher_dir)
    failures = _read_jsonl(d / "failures.jsonl", problems, ("id", "split", "reason")) or []
    _read_json(d / "manifest.json", problems)
    for split in ("train", "eval"):
        path = Path(p.completions(split))
        rows = _read_jsonl(path, problems, SUBSET_KEYS + ("completion",))
        if rows is None:
            continue
        for i, r in enumerate(rows, 1):
            if not isinstance(r.get("completion"), str) or not r["completion"].strip():
                problems.add(f"{path}:{i}", "empty completion")
        source = subset.get(split)
        if source is not None and rows:
            failed = {f["id"] for f in failures if f.get("split") == split}
            expected = [r["id"] for r in source if r["id"] not in failed]
            if [r.get("id") for r in rows] != expected:
                problems.add(
                    path,
                    f"{len(rows)} rows do not match the {len(source)} subset rows "
                    f"minus {len(failed)} failures (ids or order differ)",
                )
    if Path(p.teacher_cache).exists():
        _read_jsonl(Path(p.teacher_cache), problems, ("key", "request", "response"))
    if Path(p.teacher_refusals).exists():
        _read_jsonl(Path(p.teacher_refusals), problems, ("key", "request", "failure"))
    _metrics(Path(p.teacher_metrics), problems)


def check_data_counts(where: Path, counts: Any, problems: Problems) -> None:
    """A training manifest's data counts account for every row read: kept + every ``dropped_*`` reason = rows
    (``teacher_truncated`` and ``completion_truncated`` count rows kept or dropped, not a reason of their own)."""
    if not isinstance(counts, dict) or "rows" not in counts or "kept" not in counts:
        return
    dropped = {k: v for k, v in counts.items() if k.startswith("dropped_")}
    if counts["kept"] + sum(dropped.values()) != counts["rows"]:
        problems.add(
            where, f"data counts do not add up: kept {counts['kept']} + dropped {dropped} != rows {counts['rows']}"
        )
    for key in ("teacher_truncated", "completion_truncated"):
        if not 0 <= counts.get(key, 0) <= counts["rows"]:
            problems.add(where, f"data count {key} = {counts[key]} is not within 0..rows ({counts['rows']})")


def check_training(stage: str, paths: PathsConfig, problems: Problems, health=None) -> None:
    out = paths.training(stage)
    for f in ("config.json", "model.safetensors"):
        if not (Path(out.model) / f).is_file():
            problems.add(Path(out.model) / f, "missing")
    manifest = _read_json(Path(out.manifest), problems)
    check_data_counts(Path(out.manifest), (manifest or {}).get("data"), problems)
    steps_path = Path(out.steps)
    steps = _read_jsonl(steps_path, problems, ("step", "loss", "grad_norm", "worker_loss", "worker_tokens"))
    if steps is not None:
        if [r.get("step") for r in steps] != list(range(len(steps))):
            problems.add(steps_path, "steps are not 0..N-1 in order (a lost or repeated step)")
        if manifest and manifest.get("steps") != len(steps):
            problems.add(steps_path, f"{len(steps)} rows but manifest says {manifest.get('steps')} steps")
        for r in steps:
            if r.get("skipped"):
                continue
            for key in ("loss", "grad_norm"):
                v = r.get(key)
                if not isinstance(v, (int, float)) or not math.isfinite(v):
                    problems.add(f"{steps_path} step {r.get('step')}", f"{key} is {v}")
            if manifest and len(r.get("worker_loss", [])) != manifest.get("workers"):
                problems.add(f"{steps_path} step {r.get('step')}", "worker columns do not match the workers")
                break
        from ars_opd.rollouts.version_log import engine_problems  # plain Python

        for where, what in engine_problems(steps):  # a run with engine rollouts: its versions were verified
            problems.add(f"{steps_path} {where}", what)
        from ars_opd.training.opd.rollout_health import HealthConfig, detect, teacher_prefixes  # plain Python

        alarm = detect(steps, health or HealthConfig()).alarm  # rollouts that left their start (opd)
        if alarm is not None:
            problems.add(steps_path, alarm.line(stage))
        for teacher, prefix in teacher_prefixes(steps).items():  # several teachers: each one's rollouts too
            alarm = detect(steps, health or HealthConfig(), prefix=prefix).alarm
            if alarm is not None:
                problems.add(steps_path, alarm.line(f"{stage} ({teacher}'s prompts)"))
    _metrics(Path(out.live) / "metrics.json", problems)


def check_evaluate(p: PathsConfig, problems: Problems) -> None:
    m = _metrics(Path(p.eval_metrics), problems)
    if m:
        for model in ("base", *TRAINING_STAGES, "teacher"):
            if model not in m:
                problems.add(p.eval_metrics, f"no '{model}' entry")
        for stage in TRAINING_STAGES:
            curve = (m.get("curves") or {}).get(stage)
            if not curve:
                problems.add(p.eval_metrics, f"no learning curve for {stage}")
            elif [c.get("steps") for c in curve] != sorted(c.get("steps") for c in curve):
                problems.add(p.eval_metrics, f"the {stage} learning curve is not in step order")
    for f in ("table.md", "answers.jsonl"):
        if not (Path(p.eval_dir) / f).is_file():
            problems.add(Path(p.eval_dir) / f, "missing")
    for stage in TRAINING_STAGES:
        tsv = Path(p.eval_live) / "plots" / "metrics" / stage / "reverse_kl.tsv"
        if not tsv.is_file():
            problems.add(tsv, "missing (the learning curve through DVCLive)")


def check_report(p: PathsConfig, problems: Problems) -> None:
    if not Path(p.report_md).is_file():
        problems.add(p.report_md, "missing")
    _metrics(Path(p.report_metrics), problems)
    for name in (*TRAINING_STAGES, "learning_curves_steps", "learning_curves_flops"):
        if not (Path(p.report_figures) / f"{name}.png").is_file():
            problems.add(Path(p.report_figures) / f"{name}.png", "missing")


def check_outputs(paths: PathsConfig, stages: tuple[str, ...] = STAGES, health=None) -> list[str]:
    """All problems found in the named stages' outputs (an empty list means sound). ``health``: the rollout-health
    detector's settings (``ars_opd.training.opd.rollout_health.HealthConfig``; None: its defaults)."""
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        raise ValueError(f"unknown stage(s) {unknown}; known: {list(STAGES)}")
    problems = Problems()
    subset: dict[str, list[dict]] = {}
    if "models" in stages:
        check_models(paths, problems)
    if "subset" in stages or "teacher_gen" in stages:
        subset = check_subset(paths, problems) if "subset" in stages else check_subset(paths, Problems())
    if "teacher_gen" in stages:
        check_teacher(paths, problems, subset)
    for stage in TRAINING_STAGES:
        if stage in stages:
            check_training(stage, paths, problems, health)
    if "evaluate" in stages:
        check_evaluate(paths, problems)
    if "report" in stages:
        check_report(paths, problems)
    return list(problems)
