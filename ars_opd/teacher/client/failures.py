"""What each teacher_gen failure means for the next run, and the report that says so.

A prompt left without an answer falls in one of three cases, by the kind of its reason (the part
before the first ':'):

- **remembered**: the endpoint refused the request itself (HTTP 400, 413, 422: longer than its context,
  an invalid parameter), or answered with no text under deterministic sampling (temperature 0, or a
  seed). The same request gets the same result, so asking again only repeats the failure: the key goes
  to the refusals file (``paths.teacher_refusals``) and later runs do not ask it again unless
  ``teacher_gen.retry_failed`` is true (e.g. after raising the server's context length). Changing the
  prompt, the model or a sampling parameter changes the key, so such a request is asked afresh.
- **cached**: the cached answer itself is unusable (``empty_after_think_strip``: cut off inside its
  ``<think>`` block; or an empty answer cached by an older version). A rerun serves the same answer;
  raising ``teacher_gen.max_tokens`` (or changing another sampling parameter) changes the key.
- **asked again**: everything else (timeouts, dropped connections, 429, 5xx, malformed bodies, an
  empty answer sampled at random, a run stopped early, 401/403/404 which need the endpoint or key fixed).

The report (``paths.teacher_failure_report``, JSON) is written by every run, failed or not, outside the
DVC outputs (DVC deletes a stage's outputs before it runs, and teacher_gen writes its own all or
nothing), so the cause of a failed run is never lost: failures grouped by kind, each with its count,
what a rerun does about it, up to three distinct messages and five example prompts, then every failure.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

REFUSED_STATUS = frozenset({400, 413, 422})
REMEMBERED, CACHED, ASKED_AGAIN = "remembered", "cached", "asked_again"
RERUN_TEXT = {
    REMEMBERED: "not asked again: the same request gets the same result (set teacher_gen.retry_failed: true "
    "to ask anyway, e.g. after raising the server's context length)",
    CACHED: "served again from the answer cache (raising teacher_gen.max_tokens changes the key, so asks anew)",
    ASKED_AGAIN: "asked again",
}


def kind_of(reason: str) -> str:
    return reason.split(":", 1)[0]


def deterministic_sampling(temperature: float, seed: int | None) -> bool:
    """Whether the endpoint gives the same answer to the same request (greedy, or seeded)."""
    return temperature == 0 or seed is not None


def is_remembered(reason: str, status: int | None, deterministic: bool) -> bool:
    """Whether a failure this run saw is one a rerun cannot change (see the module docstring)."""
    if status in REFUSED_STATUS:
        return True
    return kind_of(reason) == "empty_completion" and deterministic


def rerun_effect(failure: dict, deterministic: bool) -> str:
    """REMEMBERED, CACHED or ASKED_AGAIN for a failure row ``{reason, status?, remembered?, from_cache?}``."""
    if failure.get("remembered"):
        return REMEMBERED
    if failure.get("from_cache"):
        return CACHED
    if is_remembered(failure["reason"], failure.get("status"), deterministic):
        return REMEMBERED
    return ASKED_AGAIN


def group_failures(failures: list[dict], deterministic: bool) -> dict[str, dict]:
    """Failures grouped by kind: count, rerun effect, up to 3 distinct messages, up to 5 examples."""
    groups: dict[str, dict] = defaultdict(lambda: {"count": 0, "rerun": None, "messages": [], "examples": []})
    for f in failures:
        g = groups[kind_of(f["reason"])]
        g["count"] += 1
        g["rerun"] = g["rerun"] or rerun_effect(f, deterministic)
        detail = f["reason"].split(":", 1)[1].strip() if ":" in f["reason"] else ""
        if detail and detail not in g["messages"] and len(g["messages"]) < 3:
            g["messages"].append(detail)
        if len(g["examples"]) < 5:
            g["examples"].append({"id": f["id"], "split": f["split"]})
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["count"]))


def describe(groups: dict[str, dict], total: int) -> str:
    """One line per kind, then what a rerun will and will not change."""
    lines = []
    for kind, g in groups.items():
        said = f": {' | '.join(g['messages'])}" if g["messages"] else ""
        ids = ", ".join(e["id"] for e in g["examples"][:3])
        lines.append(f"  {kind} x{g['count']}{said} (e.g. {ids}) -> next run: {RERUN_TEXT[g['rerun']]}")
    by_effect = defaultdict(int)
    for g in groups.values():
        by_effect[g["rerun"]] += g["count"]
    failed = sum(by_effect.values())
    rerun = (
        f"A rerun asks again the {by_effect[ASKED_AGAIN]} prompt(s) that failed for reasons that can pass "
        f"(answers received are cached and not asked again); it does not change the "
        f"{by_effect[REMEMBERED] + by_effect[CACHED]} whose result would be the same."
    )
    return f"{failed} of {total} prompts have no teacher answer:\n" + "\n".join(lines) + "\n" + rerun


def write_failure_report(path: str | Path, failures: list[dict], groups: dict[str, dict], summary: dict) -> None:
    """The run's failures as JSON at ``path``, written atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        **summary,
        "by_kind": {k: {**g, "rerun": RERUN_TEXT[g["rerun"]]} for k, g in groups.items()},
        "failures": failures,
    }
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)
