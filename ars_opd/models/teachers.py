"""Several teachers, one student: the route from prompts to teachers, and the teachers the models stage pinned.

The params (``teachers``: ``ars_opd.config.TeachersConfig``) name the teachers and the route: a prompt's teacher is
``route[row[route_by]]``, else ``default``. ``Route.assign`` applies it to a stage's rows, once, before the stage
does any work, and refuses in one line (a ``ConfigError`` on ``teachers.route``, exit 2) the first prompt no teacher
covers, naming its id and its route_by value: a stage never half-runs on a route with a hole in it. Every stage
that reads prompts applies the same route to the same rows (teacher_gen, opd, evaluate), so they agree on each
prompt's teacher; teacher_gen also writes it into its rows (``teacher``), and evaluate refuses rows whose recorded
teacher is not the route's (the teacher's completions would be another teacher's text).

The models stage (``ars_opd.models.prepare_teachers``) pins each named teacher in its manifest under ``teachers``
(``MANIFEST_KEY``), one entry per name:

- ``builtin``: trained there on its tasks and written to ``teachers/<name>/`` in the models directory, pinned by
  the sha256 of its files (a GGUF file is converted to that directory too);
- a hub id or a local directory: pinned as ``models.teacher`` is (commit hash, or the files' sha256 with the fast
  path of sizes and times), weights left where they are;
- ``teacher``: the models stage's own teacher (``models.teacher``), its entry pointing at that role;
- ``endpoint``: a served teacher, recorded by URL, model name and revision; there are no weights to pin.

``teacher_path`` returns the directory of a named teacher after checking its pin (``ars_opd.models.loading``'s
``verify_pin``), so no stage loads a teacher that changed after the models stage pinned it, and ``ars-opd check``
verifies every pin the same way. Torch-free apart from what ``loading`` imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ars_opd.config import ENDPOINT_SOURCE, THE_TEACHER, ConfigError, TeachersConfig
from ars_opd.models.loading import ModelSourceError, model_path, read_manifest, verify_pin

MANIFEST_KEY = "teachers"  # the manifest's entries, and the models directory's folder of written teachers
ROUTE_COLUMN = "teacher"  # teacher_gen's rows: the name of the teacher that answered


def teacher_role(name: str) -> str:
    """Where a teacher the models stage writes lives in its output (``teachers/<name>``), and its role in messages."""
    return f"{MANIFEST_KEY}/{name}"


@dataclass(frozen=True)
class Route:
    """The route of a params file's ``teachers`` section, applied to rows."""

    cfg: TeachersConfig

    @property
    def names(self) -> tuple[str, ...]:
        """The teachers in the params' order (the index a row's teacher is stored as in OPD's micro-batches)."""
        return tuple(t.name for t in self.cfg.named)

    def teacher_of(self, row: dict) -> str | None:
        column = self.cfg.route_by
        return self.cfg.teacher_of(row.get(column) if column is not None else None)

    def assign(self, rows: list[dict], where: str) -> list[str]:
        """Each row's teacher, in order; ``ConfigError`` on ``teachers.route`` naming the first row no teacher covers
        (``where``: what the rows are, e.g. the file they came from)."""
        out = []
        for i, row in enumerate(rows):
            name = self.teacher_of(row)
            if name is None:
                column = self.cfg.route_by
                value = row.get(column) if column is not None else None
                raise ConfigError(
                    "teachers.route",
                    f"row {i} of {where} (id {row.get('id')!r}, {column} {value!r}) is covered by no teacher: "
                    f"add {value!r} to teachers.route or set teachers.default",
                )
            out.append(name)
        return out

    def indices(self, rows: list[dict], where: str) -> list[int]:
        """Each row's teacher as its index in ``names``."""
        index = {name: i for i, name in enumerate(self.names)}
        return [index[name] for name in self.assign(rows, where)]


def teacher_entries(models_dir: str | Path) -> dict[str, dict]:
    """The manifest's named teachers ({} when the models stage ran with none)."""
    return read_manifest(models_dir).get(MANIFEST_KEY) or {}


def check_pinned(models_dir: str | Path, cfg: TeachersConfig) -> dict[str, dict]:
    """The manifest's entries of the params' teachers, after checking the models stage pinned exactly these (names
    and sources); else ``ModelSourceError`` saying to rerun it (the params changed since)."""
    entries = teacher_entries(models_dir)
    wanted = {t.name: t.source for t in cfg.named}
    pinned = {name: entry.get("params_source") for name, entry in entries.items()}
    if pinned != wanted:
        raise ModelSourceError(
            f"teachers.named ({', '.join(f'{n}: {s}' for n, s in wanted.items())}) are not the teachers the models "
            f"stage pinned in {Path(models_dir) / 'manifest.json'} "
            f"({', '.join(f'{n}: {s}' for n, s in pinned.items()) or 'none'}): run `dvc repro models`"
        )
    return entries


def teacher_path(models_dir: str | Path, name: str, entry: dict | None = None) -> str:
    """The directory to load the named teacher from, after checking its pin (``verify_pin``); the models stage's
    own teacher for one named ``teacher``. ``ValueError`` for an endpoint teacher, which has no weights here."""
    entry = entry if entry is not None else teacher_entries(models_dir)[name]
    if entry["source"] == ENDPOINT_SOURCE:
        raise ValueError(f"teacher {name} is an endpoint ({entry.get('url')}): it has no weights to load")
    if entry["source"] == THE_TEACHER:
        return model_path(models_dir, "teacher")
    return verify_pin(models_dir, teacher_role(name), entry)


def teacher_identity(entry: dict) -> tuple[str | None, str | None]:
    """(model name, revision) of a pinned teacher as a teacher_gen cache key and OPD's fingerprint take it: the
    pin of a model (a local model is served under the bundled server's one name, so its revision tells it apart),
    the served name and ``revision`` of an endpoint."""
    if entry["source"] == ENDPOINT_SOURCE:
        return entry.get("model"), entry.get("revision")
    return None, entry.get("revision")


def manifest_summary(entries: dict[str, dict]) -> dict[str, Any]:
    """What a stage's manifest records of its teachers: each one's source and revision (and an endpoint's URL)."""
    return {
        name: {k: e.get(k) for k in ("source", "revision", "url", "model") if e.get(k) is not None}
        for name, e in entries.items()
    }


def check_recorded(rows: list[dict], assigned: list[str], where: str) -> None:
    """Where a stage trains on or scores the teacher's completions themselves, each row's completion must be its
    routed teacher's: ``ConfigError`` on ``teachers.route`` naming the first row teacher_gen answered with another
    teacher (the route changed after teacher_gen ran), or that carries none (a one-teacher run's rows)."""
    for i, (row, name) in enumerate(zip(rows, assigned)):
        recorded = row.get(ROUTE_COLUMN)
        if recorded != name:
            raise ConfigError(
                "teachers.route",
                f"row {i} of {where} (id {row.get('id')!r}) was answered by "
                f"{'no named teacher' if recorded is None else repr(recorded)}, but the route names {name!r}: the "
                "teacher's text is not its own; rerun teacher_gen (dvc repro teacher_gen)",
            )
