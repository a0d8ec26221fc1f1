"""Several teachers through the stages other than OPD's step: the params and their refusals, the models stage's
pins, teacher_gen's route (and its kill -9), evaluate's per-row teachers.

Oracles: the params each refusal names (one line, the key); the fake endpoints' own logs of what each teacher was
asked; the models stage's manifest against the files on disk; each teacher evaluated alone on its own rows, and a
float64 recomputation of every row's reverse KL (``several_teachers.exact_row_losses``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from ars_opd.artifacts import read_jsonl, write_json, write_jsonl
from ars_opd.config import ConfigError, DataConfig, PathsConfig, SyntheticConfig, TeachersConfig, load_params
from ars_opd.data.subset import make_subset
from ars_opd.models.teachers import ROUTE_COLUMN, Route, check_recorded
from fake_endpoint import FakeEndpoint, expected_answer
from micro import committed_params
from several_teachers import ARITH, ROUTE, SPECIALISTS, WORDS, exact_row_losses, several_teachers_workspace
from tolerances import two_computations, vs_oracle

REPO = Path(__file__).resolve().parents[1]


def _params(tmp_path: Path, **sections) -> Path:
    """params.yaml of the repository with ``sections`` merged over it (one level deep), in ``tmp_path``."""
    params = committed_params()
    for name, over in sections.items():
        params[name] = {**params.get(name, {}), **over}
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    if not (tmp_path / "inputs").exists():
        (tmp_path / "inputs").symlink_to(REPO / "inputs", target_is_directory=True)
    return path


def _refused(tmp_path: Path, key: str, words: str, **sections) -> None:
    with pytest.raises(ConfigError) as e:
        load_params(_params(tmp_path, **sections), base=tmp_path)
    assert e.value.key == key, (e.value.key, str(e.value))
    assert words in e.value.message and "\n" not in str(e.value)


ENDPOINT = {"name": "served", "source": "endpoint", "endpoint": {"endpoint": "http://127.0.0.1:9/v1", "model": "m"}}


def test_the_default_params_name_no_teacher_and_every_stage_takes_them(tmp_path):
    p = load_params(_params(tmp_path), base=tmp_path)
    assert p.teachers == TeachersConfig() and not p.teachers.active
    load_params(_params(tmp_path, teachers={"named": SPECIALISTS, "route": ROUTE}), base=tmp_path)


@pytest.mark.parametrize(
    "key,words,teachers,other",
    [
        (
            "teachers.route.add",
            "names no teacher 'nobody'",
            {"named": SPECIALISTS, "route": {**ROUTE, "add": "nobody"}},
            {},
        ),
        ("teachers.default", "names no teacher 'nobody'", {"named": SPECIALISTS, "default": "nobody"}, {}),
        ("teachers.route", "no prompt would reach a teacher", {"named": SPECIALISTS}, {}),
        ("teachers.named", "none is named", {"route": ROUTE}, {}),
        (
            "teachers.named[1].name",
            "names two teachers",
            {"named": [SPECIALISTS[0], SPECIALISTS[0]], "default": "arith"},
            {},
        ),
        ("teachers.named[0].name", "letters, digits", {"named": [{"name": "a/b"}], "default": "a/b"}, {}),
        (
            "teachers.named[0].tasks",
            "only a built-in teacher",
            {"named": [{"name": "t", "source": "teacher", "tasks": ["add"]}], "default": "t"},
            {},
        ),
        (
            "teachers.named[0].steps",
            "only a built-in teacher is trained",
            {"named": [{"name": "t", "source": "teacher", "steps": 5}], "default": "t"},
            {},
        ),
        (
            "teachers.named[0].steps",
            "warmup_steps",
            {"named": [{**SPECIALISTS[0], "steps": 10}], "default": "arith"},
            {},
        ),
        (
            "teachers.named[0].endpoint.endpoint",
            "http(s) base URL",
            {"named": [{"name": "s", "source": "endpoint"}], "default": "s"},
            {},
        ),
        ("opd.loss", "full distribution", {"named": [SPECIALISTS[0], ENDPOINT], "default": "arith"}, {}),
        (
            "opd.cross_tokenizer",
            "student's tokenizer only",
            {"named": SPECIALISTS, "route": ROUTE},
            {"opd": {"cross_tokenizer": True, "loss": "sampled_token"}},
        ),
        (
            "opd.teacher",
            "opd.teacher: local",
            {"named": SPECIALISTS, "route": ROUTE},
            {"opd": {"teacher": "endpoint", "loss": "sampled_token"}},
        ),
        ("opd.anchor", "forward_kl anchor", {"named": SPECIALISTS, "route": ROUTE}, {"opd": {"anchor": "forward_kl"}}),
        (
            "teacher_gen.endpoint",
            "teacher_gen.endpoint: local",
            {"named": SPECIALISTS, "route": ROUTE},
            {"teacher_gen": {"endpoint": "http://x:8000/v1", "model": "m"}},
        ),
        (
            "teachers.named[0].source",
            "tokenise differently",
            {"named": SPECIALISTS, "route": ROUTE},
            {"models": {"student": "Qwen/Qwen3-0.6B"}, "opd": {"cross_tokenizer": False}},
        ),
    ],
)
def test_what_several_teachers_cannot_run_is_refused_naming_the_key(tmp_path, key, words, teachers, other):
    _refused(tmp_path, key, words, teachers=teachers, **other)


def test_a_local_teacher_must_lie_under_inputs_teachers(tmp_path):
    local = tmp_path / "my_models" / "math"
    local.mkdir(parents=True)
    (local / "config.json").write_text("{}")
    named = {"named": [{"name": "math", "source": str(local)}], "default": "math"}
    _refused(tmp_path, "inputs.teachers", "set inputs.teachers to a directory holding it", teachers=named)
    load_params(_params(tmp_path, teachers=named, inputs={"teachers": str(tmp_path / "my_models")}), base=tmp_path)
    # and no local teacher: the placeholder only
    _refused(
        tmp_path,
        "inputs.teachers",
        "nothing for DVC to hash",
        teachers={"named": SPECIALISTS, "route": ROUTE},
        inputs={"teachers": str(tmp_path / "my_models")},
    )


def test_the_route_assigns_every_row_or_names_the_first_it_cannot():
    route = Route(_teachers({"named": SPECIALISTS, "route": ROUTE}))
    rows = [{"id": "a", "task": "add"}, {"id": "b", "task": "reverse"}, {"id": "c", "task": "length"}]
    assert route.assign(rows, "x") == ["arith", "words", "arith"]
    assert route.indices(rows, "x") == [0, 1, 0]
    partial = Route(_teachers({"named": SPECIALISTS, "route": {"add": "arith", "reverse": "words"}}))
    with pytest.raises(ConfigError, match=r"row 2 of x \(id 'c', task 'length'\) is covered by no teacher"):
        partial.assign(rows, "x")
    fallback = Route(_teachers({"named": SPECIALISTS, "route": {"reverse": "words"}, "default": "arith"}))
    assert fallback.assign(rows, "x") == ["arith", "words", "arith"]
    everyone = Route(_teachers({"named": SPECIALISTS, "route_by": None, "default": "words"}))
    assert everyone.assign(rows, "x") == ["words"] * 3
    with pytest.raises(ConfigError, match="answered by 'words', but the route names 'arith'"):
        check_recorded([{**r, ROUTE_COLUMN: "words"} for r in rows], route.assign(rows, "x"), "x")


def _teachers(raw: dict) -> TeachersConfig:
    from ars_opd.config import parse_section

    return parse_section(TeachersConfig, raw, "teachers")


# --------------------------------------------------------------------------------------------------
# the models stage


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("several")
    named = [{**SPECIALISTS[0], "steps": 25}, SPECIALISTS[1], {"name": "main", "source": "teacher"}]
    several_teachers_workspace(root, {"named": named, "route": ROUTE})
    return root


def test_the_models_stage_pins_every_teacher_and_check_verifies_each(workspace):
    from ars_opd.checks import check_outputs
    from ars_opd.models.loading import read_manifest

    cwd = os.getcwd()
    os.chdir(workspace)
    try:
        paths = load_params("params.yaml").paths
        manifest = read_manifest(paths.models_dir)
        entries = manifest["teachers"]
        assert sorted(entries) == ["arith", "main", "words"]
        assert entries["arith"]["tasks"] == list(ARITH) and entries["words"]["tasks"] == list(WORDS)
        assert entries["main"]["revision"] == manifest["teacher"]["revision"]
        assert len({entries[n]["revision"] for n in ("arith", "words", "main")}) == 3  # three different teachers
        metrics = json.loads(Path(paths.models_metrics).read_text())["teachers"]
        assert set(metrics) == {"arith", "words"} and metrics["arith"]["tasks"] == list(ARITH)
        assert (
            metrics["arith"]["train_steps"] == 25 and metrics["words"]["train_steps"] == 20
        )  # its own, or the default
        assert check_outputs(paths, ("models",)) == []
        weights = Path(paths.models_dir) / "teachers" / "words" / "model.safetensors"
        original = weights.read_bytes()
        try:
            weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # one bit of words' weights
            problems = check_outputs(paths, ("models",))
            assert len(problems) == 1 and "teachers.words" in problems[0] and "changed" in problems[0]
        finally:
            weights.write_bytes(original)
    finally:
        os.chdir(cwd)


# --------------------------------------------------------------------------------------------------
# teacher_gen

_STAGE = [sys.executable, str(REPO / "stages" / "teacher_gen.py")]


def _teacher_gen_workspace(root: Path, urls: dict[str, str], route: dict, n: int, eval_size: int, **teacher_gen):
    """A subset, a models manifest naming two endpoint teachers (what the models stage records of them), params."""
    os.chdir(root)
    paths = PathsConfig()
    res = make_subset(DataConfig(subset_size=n, eval_size=eval_size), SyntheticConfig(), seed=0)
    Path(paths.subset_train).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(paths.subset_train, res.train)
    write_jsonl(paths.subset_eval, res.eval)
    named = [
        {"name": name, "source": "endpoint", "endpoint": {"endpoint": url, "model": f"fake-{name}", "concurrency": 4}}
        for name, url in urls.items()
    ]
    Path(paths.models_dir).mkdir(parents=True, exist_ok=True)
    write_json(
        Path(paths.models_dir) / "manifest.json",
        {
            "teachers": {
                name: {"source": "endpoint", "params_source": "endpoint", "url": url, "model": f"fake-{name}"}
                for name, url in urls.items()
            }
        },
    )
    params = committed_params()
    params["teachers"] = {"named": named, "route": route}
    params["teacher_gen"].update({"request_timeout_s": 5.0, **teacher_gen})
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    return paths


@pytest.fixture
def in_tmp(tmp_path):
    cwd = os.getcwd()
    yield tmp_path
    os.chdir(cwd)


def test_a_prompt_no_teacher_covers_stops_teacher_gen_before_any_request_in_one_line(in_tmp):
    with FakeEndpoint(model="fake-a") as a, FakeEndpoint(model="fake-b") as b:
        route = {"add": "a", "sort_digits": "a", "reverse": "b", "uppercase": "b"}  # no teacher for length
        _teacher_gen_workspace(in_tmp, {"a": a.base_url, "b": b.base_url}, route, n=40, eval_size=8)
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        run = subprocess.run(_STAGE, cwd=in_tmp, env=env, capture_output=True, text=True, timeout=300)
        assert a.log == [] and b.log == []
    assert run.returncode == 2, run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "teachers.route" in lines[0] and "task 'length'" in lines[0], run.stderr


@pytest.mark.slow
def test_kill_9_mid_run_with_two_teachers_then_resume_asks_nothing_twice(in_tmp):
    """Two served teachers (fake endpoints), routed by task; the stage is killed while the second is being asked.
    The rerun asks only what is missing, each prompt of its own teacher only, and every row names its teacher."""
    route = {**{t: "a" for t in ARITH}, **{t: "b" for t in WORDS}}
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with FakeEndpoint(model="fake-a", latency_s=0.02) as a, FakeEndpoint(model="fake-b", latency_s=0.05) as b:
        paths = _teacher_gen_workspace(in_tmp, {"a": a.base_url, "b": b.base_url}, route, n=400, eval_size=40)
        rows = read_jsonl(paths.subset_train) + read_jsonl(paths.subset_eval)
        by_teacher = {name: {r["messages"][-1]["content"] for r in rows if route[r["task"]] == name} for name in "ab"}
        proc = subprocess.Popen(_STAGE, cwd=in_tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        cache = Path(paths.teacher_cache)
        deadline = time.monotonic() + 180
        target = len(by_teacher["a"]) + 30  # a is asked first: kill in the middle of b
        while (not cache.exists() or cache.read_bytes().count(b"\n") < target) and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not Path(paths.teacher_dir).exists()
        before = {
            json.loads(line)["request"]["messages"][-1]["content"]
            for line in cache.read_text().splitlines()
            if _valid(line)
        }
        assert len(by_teacher["a"]) < len(before) < len(rows)
        first = {name: len(ep.log) for name, ep in (("a", a), ("b", b))}
        second = subprocess.run(_STAGE, cwd=in_tmp, env=env, capture_output=True, text=True, timeout=300)
        assert second.returncode == 0, second.stderr[-2000:]
        for name, ep in (("a", a), ("b", b)):
            asked = {e["prompt"] for e in ep.log}
            assert asked == by_teacher[name], f"teacher {name} was asked another teacher's prompts"
            again = {e["prompt"] for e in ep.log[first[name] :]}
            assert not again & before, f"teacher {name} was asked again what the killed run had cached"
    keys = [json.loads(line)["key"] for line in cache.read_text().splitlines()]
    assert len(keys) == len(set(keys)) == len(rows)
    for split in ("train", "eval"):
        for r in read_jsonl(paths.completions(split)):
            assert r[ROUTE_COLUMN] == route[r["task"]]
            assert r["completion"] == expected_answer(r["messages"][-1]["content"])
    m = json.loads(Path(paths.teacher_metrics).read_text())
    assert m["cached_before_run"] == len(before) and m["answered"] == len(rows) - len(before)
    assert sum(v["train"] + v["eval"] for v in m["rows_per_teacher"].values()) == len(rows)


def _valid(line: str) -> bool:
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


def test_the_same_prompt_is_keyed_apart_for_two_teachers():
    from ars_opd.config import TeacherGenConfig
    from ars_opd.teacher.client.generate import build_requests

    rows = [{"messages": [{"role": "user", "content": "hi"}]}]
    cfg = TeacherGenConfig()
    a = build_requests(rows, cfg, "ars-opd-teacher", "sha-of-arith")[0]
    b = build_requests(rows, cfg, "ars-opd-teacher", "sha-of-words")[0]
    assert a.key != b.key and a.body == b.body  # the same request, answered and cached per teacher


# --------------------------------------------------------------------------------------------------
# evaluate


def test_evaluate_measures_each_row_against_its_own_teacher(workspace):
    from transformers import AutoModelForCausalLM

    from ars_opd.config import EvaluateConfig
    from ars_opd.data.prompts import encode_completions, encode_prompts
    from ars_opd.evaluation.row_teachers import RowTeachers
    from ars_opd.evaluation.token_losses import (
        TeacherTextRows,
        own_samples,
        reverse_kl_on_own_samples,
        teacher_text_scores,
    )
    from ars_opd.lm.batching import cut_at_first_eos
    from ars_opd.models.loading import load_model, load_tokenizer
    from ars_opd.models.teachers import teacher_path
    from micro import teacher_rows

    models_dir = str(workspace / load_params(workspace / "params.yaml").paths.models_dir)
    tokenizer = load_tokenizer(models_dir)
    vocab, device = len(tokenizer), torch.device("cpu")
    student = load_model(models_dir, "student").eval()
    names = ("arith", "words")
    teachers = [AutoModelForCausalLM.from_pretrained(teacher_path(models_dir, n)).eval() for n in names]
    rows = teacher_rows(10, seed=11)
    index = [names.index(ROUTE[r["task"]]) for r in rows]
    assert set(index) == {0, 1}
    prompts = encode_prompts(tokenizer, [r["messages"] for r in rows])
    completions = encode_completions(tokenizer, [r["completion"] for r in rows])
    cfg = EvaluateConfig(max_new_tokens=8, batch_size=4, chunk_size=5)
    routed = RowTeachers(names, teachers, index)
    drawn = own_samples(student, tokenizer, prompts, cfg)
    with torch.no_grad():
        got = reverse_kl_on_own_samples(student, routed, tokenizer, prompts, cfg, vocab, device, drawn)
        text = TeacherTextRows.compute(routed, tokenizer, prompts, completions, cfg, device)
        fixed = teacher_text_scores(
            student, tokenizer, prompts, completions, cfg, vocab, device, (routed, text)
        ).reverse_kl
    alone_rkl, alone_fixed = [0.0] * len(rows), [0.0] * len(rows)
    for k, teacher in enumerate(teachers):  # each teacher alone on its own rows, as a one-teacher evaluation
        mine = [i for i, o in enumerate(index) if o == k]
        p, c = [prompts[i] for i in mine], [completions[i] for i in mine]
        own = ([drawn[0][i] for i in mine], drawn[1])
        with torch.no_grad():
            rkl = reverse_kl_on_own_samples(student, teacher, tokenizer, p, cfg, vocab, device, own)
            t_text = TeacherTextRows.compute(teacher, tokenizer, p, c, cfg, device)
            fx = teacher_text_scores(student, tokenizer, p, c, cfg, vocab, device, (teacher, t_text)).reverse_kl
        for j, i in enumerate(mine):
            alone_rkl[i], alone_fixed[i] = rkl.row_sums[j], fx.row_sums[j]
    width = max(len(p) for p in prompts) + max(len(c) for c in completions) + cfg.max_new_tokens
    for i, k in enumerate(index):
        sample = cut_at_first_eos(drawn[0][i], drawn[1])[0]
        for value, alone, completion in ((got, alone_rkl, sample), (fixed, alone_fixed, completions[i])):
            (exact,), (bound,) = exact_row_losses(
                student, teachers[k], [prompts[i]], [completion], "divergence", 1.0, tokenizer, width
            )
            (wrong,), _ = exact_row_losses(
                student, teachers[1 - k], [prompts[i]], [completion], "divergence", 1.0, tokenizer, width
            )
            assert abs(value.row_sums[i] - alone[i]) <= two_computations(bound), (i, value.row_sums[i], alone[i])
            assert abs(value.row_sums[i] - exact) <= vs_oracle(bound)
            assert abs(value.row_sums[i] - wrong) > 10 * two_computations(bound)


def test_evaluate_refuses_an_endpoint_teacher_and_another_teachers_text(workspace):
    from ars_opd.evaluation.evaluate import several_teachers

    paths = load_params(workspace / "params.yaml").paths
    rows = [{"id": "0", "task": "add"}, {"id": "1", "task": "reverse"}]
    served = _teachers({"named": [SPECIALISTS[0], {**ENDPOINT, "name": "words"}], "route": ROUTE})
    labelled = [{**rows[0], ROUTE_COLUMN: "arith"}, {**rows[1], ROUTE_COLUMN: "words"}]
    with pytest.raises(ConfigError) as e:
        several_teachers(served, paths, labelled, False, "cpu", torch.float32)
    assert e.value.key == "teachers.named[1].source" and "endpoint teacher words" in e.value.message
    with pytest.raises(ConfigError, match="was answered by 'arith', but the route names 'words'"):
        several_teachers(served, paths, [{**r, ROUTE_COLUMN: "arith"} for r in rows], False, "cpu", torch.float32)
