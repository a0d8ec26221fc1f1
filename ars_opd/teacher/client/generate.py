"""The ``teacher_gen`` stage: a teacher completion for every prompt of the subset, resumable.

Flow: read the subset splits; build one request per prompt (the configured system prompt prepended
where a prompt has none) and its cache key; ask only for keys missing from the persistent cache
(``ars_opd.teacher.client.chat``); join answers back to the prompts in subset order. With ``endpoint: local``
the stage starts the bundled server (``ars_opd.serving.server``) on 127.0.0.1 for the teacher pinned by the
models stage, and stops it afterwards, also on errors and Ctrl-C.

Cross-tokenizer runs (the models stage's manifest says ``cross_tokenizer``): the bundled server loads the tokenizer
of the teacher's own model directory, so it renders every prompt with the teacher's chat template and ends at the
teacher's EOS; the stage checks before asking that this tokenizer is the teacher's own one the models stage saved
(``teacher_tokenizer/``, ``check_served_tokenizer``), never the student's. Nothing here reads token ids: the
answers are stored as text (in the cache and in the rows), and each training stage tokenises that text with the
student's tokenizer (``ars_opd.data.prompts.encode_teacher_completions``), so no teacher id is ever read as a
student id. A teacher's answer does not depend on the student's tokenizer, so the cache keys leave it out.

The cache key covers model name, model revision (the teacher's file hash for the local server, or
``teacher_gen.model_revision``), messages and sampling parameters; so retraining the teacher or
changing temperature asks again, and rerunning after a crash asks only for what is missing.

Outputs (written only when the failure fraction is within ``teacher_gen.max_failure_fraction``), in
``paths.teacher_dir``: ``train.jsonl``/``eval.jsonl`` rows ``{id, messages, reference, task, completion,
finish_reason, key}`` in subset order, where ``completion`` has a leading ``<think>…</think>`` block
removed (the raw answer stays in the cache; a split not in ``teacher_gen.splits`` gives an empty file);
``failures.jsonl`` rows ``{id, split, key, reason, attempts}``; ``manifest.json`` (config, model,
revision, versions). Metrics (counts, failures by reason, throughput) go to ``paths.teacher_metrics``.

Failures (``ars_opd.teacher.client.failures``): every run past its setup writes ``paths.teacher_failure_report``,
also when it then fails, grouped by reason with what a rerun will and will not change. Requests whose
failure a rerun cannot change (refused with 400/413/422, an empty answer at temperature 0) are kept in
``paths.teacher_refusals`` and not asked again unless ``teacher_gen.retry_failed``; empty answers are
never cached. The API key is read from the environment variable named in params, passed to the client,
and written nowhere.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import sys
from pathlib import Path

from ars_opd.artifacts import atomic_outputs, provenance, read_jsonl, write_json, write_jsonl
from ars_opd.config import LOCAL_ENDPOINT, ConfigError, PathsConfig, TeacherGenConfig, TeachersConfig, to_dict
from ars_opd.models.loading import cross_tokenizer, load_teacher_tokenizer
from ars_opd.models.teachers import ROUTE_COLUMN, Route
from ars_opd.serving.local_server import LOCAL_MODEL_NAME, batch_rows, local_server
from ars_opd.teacher.client import endpoint
from ars_opd.teacher.client.askers import Asker, bundled_server, merged, routed_askers, single_asker
from ars_opd.teacher.client.cache import TeacherCache, cache_key
from ars_opd.teacher.client.chat import AskSummary, TeacherRequest, ask_all, count_by_reason
from ars_opd.teacher.client.endpoint import ClientSettings
from ars_opd.teacher.client.failures import (
    describe,
    deterministic_sampling,
    group_failures,
    is_remembered,
    write_failure_report,
)

# what callers import from here: the stage's own names, and the servers it starts (``askers``)
__all__ = [
    "LOCAL_MODEL_NAME",
    "REMOTE_CONCURRENCY",
    "MissingAPIKeyError",
    "TeacherGenerationError",
    "build_requests",
    "bundled_server",
    "check_served_tokenizer",
    "generate_teacher_completions",
    "local_server",
    "resolve_concurrency",
    "strip_thinking",
]

SPLITS = ("train", "eval")
FAILURES_FILE, MANIFEST_FILE = "failures.jsonl", "manifest.json"
FAILURE_KEYS = ("id", "split", "key", "reason", "attempts")  # the rows of failures.jsonl
REMOTE_CONCURRENCY = 32  # teacher_gen.concurrency: null for a URL, whose batching this stage cannot know
_THINK = re.compile(r"^\s*<think>.*?</think>\s*", re.DOTALL)


class TeacherGenerationError(RuntimeError):
    """Too many prompts ended without an answer, or the setup is wrong."""


class MissingAPIKeyError(TeacherGenerationError, endpoint.MissingAPIKeyError):
    """``teacher_gen.api_key_env`` names a variable that is not set: a setup error of this stage, and one
    about the endpoint's key (an ``EndpointError``), so the stage prints its message alone."""


def strip_thinking(text: str) -> str:
    """Remove one leading ``<think>…</think>`` block; an unterminated block leaves nothing to train on."""
    stripped = _THINK.sub("", text, count=1)
    if stripped == text and text.lstrip().startswith("<think>"):
        return ""  # the answer was cut off inside its reasoning
    return stripped


def resolve_concurrency(cfg: TeacherGenConfig) -> int:
    """``teacher_gen.concurrency``, or when null what suits the endpoint: for the bundled server two of its
    batches of ``max_tokens`` answers (``batch_rows``), so that one batch runs while the next waits complete
    behind it and no request waits behind more than one batch (more in flight would only queue, and queue
    time counts against ``request_timeout_s``); for a URL ``REMOTE_CONCURRENCY``."""
    if cfg.concurrency is not None:
        return cfg.concurrency
    if cfg.endpoint != LOCAL_ENDPOINT:
        return REMOTE_CONCURRENCY
    return 2 * batch_rows(cfg.server, cfg.max_tokens)


def check_served_tokenizer(models_dir: str, teacher_dir: str) -> None:
    """In a cross-tokenizer run, refuse to serve the teacher with a tokenizer other than its own: the bundled server
    renders chat with the tokenizer in ``teacher_dir`` (the teacher's model directory), which must match the
    teacher's own tokenizer the models stage saved (vocabulary, chat template, EOS), or the teacher would be asked
    in the student's template and tokens. Nothing to check when teacher and student share one tokenizer."""
    if not cross_tokenizer(models_dir):
        return
    from transformers import AutoTokenizer

    served, own = AutoTokenizer.from_pretrained(teacher_dir), load_teacher_tokenizer(models_dir)
    differs = [
        what
        for what, a, b in (
            ("vocabulary", served.get_vocab(), own.get_vocab()),
            ("chat template", served.chat_template, own.chat_template),
            ("EOS token", served.eos_token, own.eos_token),
        )
        if a != b
    ]
    if differs:
        raise TeacherGenerationError(
            f"the bundled server would answer with the tokenizer in {teacher_dir}, whose {', '.join(differs)} "
            f"differ from the teacher's own tokenizer in {models_dir}/teacher_tokenizer: the teacher must be asked "
            "in its own chat template and tokens. Rerun the models stage (dvc repro models)."
        )


def build_requests(
    rows: list[dict], cfg: TeacherGenConfig, model: str, model_revision: str | None
) -> list[TeacherRequest]:
    """One request per row, keyed by sha256 of everything that determines the answer."""
    sampling = {"temperature": cfg.temperature, "top_p": cfg.top_p, "max_tokens": cfg.max_tokens}
    if cfg.seed is not None:
        sampling["seed"] = cfg.seed
    if cfg.stop:
        sampling["stop"] = list(cfg.stop)
    out = []
    for row in rows:
        messages = row["messages"]
        if cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}, *messages]
        identity = {"model": model, "model_revision": model_revision, "messages": messages, "sampling": sampling}
        out.append(TeacherRequest(cache_key(identity), {"model": model, "messages": messages, **sampling}, identity))
    return out


def _join(
    rows: dict[str, list[dict]],
    requests: dict[str, list[TeacherRequest]],
    answers: dict[str, dict],
    failed: dict[str, dict],
    strip: bool,
    assigned: dict[str, list[str | None]] | None = None,
) -> tuple[dict[str, list[dict]], list[dict]]:
    """Answers joined to their prompts in subset order, and one failure row per prompt left without one.
    ``assigned``: each row's teacher of several (``teachers.named``), written into its row as ``teacher``."""
    outputs: dict[str, list[dict]] = {}
    failures: list[dict] = []
    for split in SPLITS:
        outputs[split] = []
        owners = assigned[split] if assigned is not None else [None] * len(rows[split])
        for row, req, owner in zip(rows[split], requests[split], owners):
            entry = answers.get(req.key)
            base = {"id": row["id"], "split": split, "key": req.key}
            if entry is None:
                failures.append({**base, **failed.get(req.key, {"reason": "not_asked", "attempts": 0})})
                continue
            raw = entry["response"]["content"]
            text = strip_thinking(raw) if strip else raw
            if not text.strip():  # an empty answer cached by an older version, or cut inside <think>
                failures.append(
                    {
                        **base,
                        "reason": "empty_after_think_strip" if raw.strip() else "empty_completion",
                        "attempts": 0,
                        "from_cache": True,
                    }
                )
                continue
            outputs[split].append(
                {
                    **{k: row[k] for k in ("id", "messages", "reference", "task")},
                    "completion": text,
                    "finish_reason": entry["response"].get("finish_reason"),
                    "key": req.key,
                    **({ROUTE_COLUMN: owner} if owner is not None else {}),
                }
            )
    return outputs, failures


def generate_teacher_completions(
    cfg: TeacherGenConfig,
    paths: PathsConfig,
    progress: bool = True,
    log_requests: str | None = None,
    teachers: TeachersConfig | None = None,
) -> dict:
    """Run the stage; returns its metrics. Raises ``TeacherGenerationError`` above the failure threshold.

    Every run past its setup writes ``paths.teacher_failure_report`` (also when it then fails). A null
    ``concurrency`` is resolved first (``resolve_concurrency``), so the manifest records the number used.
    ``teachers``: with teachers named, each prompt is asked of its own teacher (``ars_opd.models.teachers.Route``,
    which refuses a prompt no teacher covers before any request), one teacher after another
    (``ars_opd.teacher.client.askers``); every row then says which teacher answered it (``teacher``)."""
    cfg = dataclasses.replace(cfg, concurrency=resolve_concurrency(cfg))
    split_paths = {"train": paths.subset_train, "eval": paths.subset_eval}  # teacher_gen reads the subset
    rows = {split: read_jsonl(split_paths[split]) if split in cfg.splits else [] for split in SPLITS}
    several = teachers is not None and teachers.active
    if several:  # before any work: every prompt has a teacher, every key variable is set, every pin holds
        if cfg.endpoint != LOCAL_ENDPOINT:
            raise ConfigError(
                "teacher_gen.endpoint",
                "with teachers.named each teacher's source says where it answers (source: endpoint for a served "
                "one); set teacher_gen.endpoint: local",
            )
        route = Route(teachers)
        assigned = {split: route.assign(rows[split], split_paths[split]) for split in SPLITS}
        askers = routed_askers(cfg, paths, teachers, MissingAPIKeyError, log_requests)
    else:
        # before any work: a missing key is an immediate, clear error
        api_key = endpoint.api_key(cfg.api_key_env, "teacher_gen", MissingAPIKeyError)
        assigned = None
        askers = {None: single_asker(cfg, paths, api_key, log_requests, check_served_tokenizer)}
    requests = {split: _requests(rows[split], cfg, askers, assigned and assigned[split]) for split in SPLITS}
    owner = {
        r.key: a
        for split in SPLITS
        for r, a in zip(requests[split], assigned[split] if several else [None] * len(rows[split]))
    }
    unique = list({r.key: r for split in SPLITS for r in requests[split]}.values())
    deterministic = deterministic_sampling(cfg.temperature, cfg.seed)
    total = sum(len(rows[s]) for s in SPLITS)

    summary = AskSummary()
    failed: dict[str, dict] = {}  # key -> {reason, attempts, status?, remembered?}
    # both files are the stage's DVC outputs: sorted on close, so identical runs write identical bytes
    with (
        TeacherCache(paths.teacher_cache, sorted_on_close=True) as cache,
        TeacherCache(paths.teacher_refusals, sorted_on_close=True) as refusals,
    ):
        if cache.dropped_torn_line:
            print(
                f"teacher cache: dropped a torn last line in {paths.teacher_cache} (from an interrupted run)",
                file=sys.stderr,
            )
        cached_before = sum(r.key in cache for r in unique)
        missing = [r for r in unique if r.key not in cache]
        remembered = [] if cfg.retry_failed else [r for r in missing if r.key in refusals]
        for r in remembered:
            f = refusals.get(r.key)["failure"]
            failed[r.key] = {**f, "remembered": True}
        to_ask = [r for r in missing if r.key not in failed]
        for name, asker in askers.items():  # one teacher after another, each with its own server
            group = [r for r in to_ask if owner[r.key] == name]
            if not group:
                continue
            try:
                with asker.server() as base_url:
                    settings = ClientSettings(base_url, asker.api_key, asker.limits)
                    summary = merged(summary, asyncio.run(ask_all(group, cache, settings, progress=progress)))
            except endpoint.EndpointError as e:  # stopped early: report what it saw, then fail with the cause
                if e.summary is not None:
                    _record(merged(summary, e.summary), refusals, {r.key: r for r in to_ask}, failed, deterministic)
                    _, failures = _join(
                        rows,
                        requests,
                        {r.key: cache.get(r.key) for r in unique if r.key in cache},
                        failed,
                        cfg.strip_thinking,
                        assigned,
                    )
                    _report(paths, failures, deterministic, total, cfg, stage_failed=True)
                raise
        _record(summary, refusals, {r.key: r for r in to_ask}, failed, deterministic)
        answers = {r.key: cache.get(r.key) for r in unique if r.key in cache}
    outputs, failures = _join(rows, requests, answers, failed, cfg.strip_thinking, assigned)

    by_reason = count_by_reason(f["reason"] for f in failures)
    over = bool(total) and len(failures) / total > cfg.max_failure_fraction
    description = _report(paths, failures, deterministic, total, cfg, stage_failed=over)
    metrics = {
        "prompts": total,
        "unique_requests": len(unique),
        "cached_before_run": cached_before,
        "remembered_failures": len(remembered),
        "asked": len(to_ask),
        "answered": summary.completed,
        "failed": len(failures),
        "failed_fraction": round(len(failures) / total, 6) if total else 0.0,
        "failures_by_reason": by_reason,
        "retries": summary.retries,
        "seconds": round(summary.seconds, 2),
        "requests_per_s": round(summary.completed / summary.seconds, 2) if summary.seconds else None,
        "length_finish_fraction": round(
            sum(r["finish_reason"] == "length" for s in outputs.values() for r in s) / max(1, total - len(failures)), 4
        ),
        **{f"{split}_rows": len(outputs[split]) for split in SPLITS},
    }
    if several:  # the rows each teacher answered, per split
        metrics["rows_per_teacher"] = {
            name: {split: sum(r[ROUTE_COLUMN] == name for r in outputs[split]) for split in SPLITS} for name in askers
        }
    if over:
        raise TeacherGenerationError(
            f"{description}\n{len(failures) / total:.1%} failed > teacher_gen.max_failure_fraction = "
            f"{cfg.max_failure_fraction:.1%}, so the stage wrote no outputs. Every failure, grouped by reason: "
            f"{paths.teacher_failure_report}."
        )
    if failures:
        print(description, file=sys.stderr)
    if several:
        who = {
            "teachers": {
                a.name: {"model": a.model, "model_revision": a.revision, "endpoint": a.endpoint}
                for a in askers.values()
            },
            "route": to_dict(teachers),
        }
    else:
        (asker,) = askers.values()
        who = {"model": asker.model, "model_revision": asker.revision, "endpoint": cfg.endpoint}
    with atomic_outputs(paths.teacher_dir, paths.teacher_metrics) as (out_dir, metrics_tmp):
        out_dir.mkdir(parents=True)
        for split in SPLITS:
            write_jsonl(out_dir / Path(paths.completions(split)).name, outputs[split])
        write_jsonl(out_dir / FAILURES_FILE, [{k: f[k] for k in FAILURE_KEYS} for f in failures])
        write_json(out_dir / MANIFEST_FILE, {**who, **provenance({"teacher_gen": to_dict(cfg)})})
        write_json(metrics_tmp, metrics)
    return metrics


def _requests(
    rows: list[dict], cfg: TeacherGenConfig, askers: dict[str | None, Asker], assigned: list[str] | None
) -> list[TeacherRequest]:
    """One request per row, in order: for the one teacher all at once, else each row keyed by its own teacher's
    model and revision (``assigned``)."""
    if assigned is None:
        (asker,) = askers.values()
        return build_requests(rows, cfg, asker.model, asker.revision)
    return [build_requests([row], cfg, askers[a].model, askers[a].revision)[0] for row, a in zip(rows, assigned)]


def _record(
    summary: AskSummary,
    refusals: TeacherCache,
    asked: dict[str, TeacherRequest],
    failed: dict[str, dict],
    deterministic: bool,
) -> None:
    """This run's failures into ``failed``; those a rerun cannot change also into the refusals file."""
    for f in summary.failures:
        failed[f.key] = {"reason": f.reason, "attempts": f.attempts, "status": f.status}
        if is_remembered(f.reason, f.status, deterministic):
            refusals.append(
                {
                    "key": f.key,
                    "request": asked[f.key].identity,
                    "failure": {"reason": f.reason, "attempts": f.attempts, "status": f.status},
                }
            )


def _report(
    paths: PathsConfig, failures: list[dict], deterministic: bool, total: int, cfg: TeacherGenConfig, stage_failed: bool
) -> str:
    groups = group_failures(failures, deterministic)
    write_failure_report(
        paths.teacher_failure_report,
        failures,
        groups,
        {
            "prompts": total,
            "failed": len(failures),
            "stage_failed": stage_failed,
            "max_failure_fraction": cfg.max_failure_fraction,
            "retry_failed": cfg.retry_failed,
        },
    )
    return describe(groups, total)
