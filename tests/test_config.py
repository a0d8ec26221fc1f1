from pathlib import Path

import pytest
import yaml

from ars_opd.config import (
    SECTIONS,
    ArchConfig,
    ConfigError,
    DataConfig,
    ModelsConfig,
    load_params,
    parse_section,
    to_dict,
)
from micro import committed_params, committed_params_file

REPO = Path(__file__).resolve().parents[1]


def test_committed_params_yaml_loads_every_section(repo_root):
    """The committed params.yaml (what a clean clone runs, and what the tests build their configs from)."""
    params = load_params(committed_params_file(), base=repo_root)
    for name in SECTIONS:
        assert getattr(params, name) is not None, name
    assert params.models.teacher == "builtin"
    # the real file sets every key explicitly: nothing silently falls back to a code default
    raw = committed_params()
    assert to_dict(params.models) == raw["models"]
    assert to_dict(params.paths) == raw["paths"]


def test_workspace_params_yaml_loads_every_section(repo_root):
    """The working params.yaml, what ``dvc repro`` and ``ars-opd`` read here, passes every check a stage runs,
    whatever experiment is applied to it (``make repro-real`` leaves the real profile's); in a clean clone it is
    the committed file above."""
    params = load_params(repo_root / "params.yaml")
    for name in SECTIONS:
        assert getattr(params, name) is not None, name


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "params.yaml"
    p.write_text(text)
    return p


def test_unknown_key_is_named_with_allowed_keys(tmp_path):
    p = _write(tmp_path, "models:\n  teacher_training:\n    learning_rate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_params(p, sections=("models",))
    assert e.value.key == "models.teacher_training.learning_rate"
    assert "lr" in str(e.value) and "steps" in str(e.value)


def test_a_float_without_a_dot_is_a_float(tmp_path):
    """DVC writes an experiment's floats below 1e-4 as 5e-05 (YAML 1.2), which YAML 1.1 reads as a string."""
    p = _write(tmp_path, "opd:\n  lr: 5e-05\n  temperature: 1E+0\nsft:\n  lr: 3e-4\n  steps: 120\n")
    params = load_params(p, sections=("opd", "sft"))
    assert params.opd.lr == 5e-05 and params.opd.temperature == 1.0 and params.sft.lr == 3e-4
    assert isinstance(params.sft.steps, int)


def test_unknown_section_rejected(tmp_path):
    p = _write(tmp_path, "modles:\n  teacher: builtin\n")
    with pytest.raises(ConfigError, match="modles"):
        load_params(p)


@pytest.mark.parametrize(
    "section, raw, key, fragment",
    [
        ("data", {"eval_size": 500, "subset_size": 100}, "data.eval_size", "smaller than subset_size"),
        ("data", {"max_malformed_fraction": 1.5}, "data.max_malformed_fraction", "[0, 1]"),
        ("data", {"format": "xml"}, "data.format", "one of"),
        ("data", {"subset_size": "many"}, "data.subset_size", "integer"),
        ("data", {"drop_duplicates": "yes"}, "data.drop_duplicates", "true or false"),
        (
            "models",
            {"teacher_arch": {"hidden_size": 100, "num_heads": 3}},
            "models.teacher_arch.num_heads",
            "divisible",
        ),
        ("models", {"teacher_training": {"lr": 0}}, "models.teacher_training.lr", "(0, 1)"),
        ("synthetic", {"tasks": ["add", "divide"]}, "synthetic.tasks", "divide"),
        ("synthetic", {"min_len": 5, "max_len": 4}, "synthetic.max_len", "min_len"),
        ("paths", {"models_dir": "/abs/models"}, "paths.models_dir", "relative"),
        ("base", {"seed": True}, "base.seed", "integer"),
        ("sft", {"steps": 10, "warmup_steps": 30}, "sft.warmup_steps", "must be <= steps (10)"),
        ("opd", {"steps": 5, "warmup_steps": 6}, "opd.warmup_steps", "must be <= steps (5)"),
        (
            "models",
            {"teacher_training": {"steps": 50, "warmup_steps": 100}},
            "models.teacher_training.warmup_steps",
            "lower warmup_steps or raise steps",
        ),
        ("inputs", {"data": "~/alpaca.jsonl"}, "inputs.data", "DVC does not expand"),
    ],
)
def test_bad_values_name_key_and_allowed(section, raw, key, fragment):
    with pytest.raises(ConfigError) as e:
        parse_section(SECTIONS[section], raw, section)
    assert e.value.key == key
    assert fragment in str(e.value)


@pytest.mark.parametrize(
    "raw, key, fragment",
    [
        ({"loss": "top_k"}, "opd.loss", "full_vocab"),
        ({"loss": "sampled_token", "beta": 0.5}, "opd.beta", "reverse KL only"),
        ({"loss": "sampled_token", "on_policy_fraction": 0.5}, "opd.on_policy_fraction", "sampled from the student"),
        ({"loss": "sampled_token", "sample_temperature": 0.7}, "opd.sample_temperature", "== temperature"),
        ({"loss": "sampled_token", "top_p": 0.9}, "opd.sample_temperature", "top_p == 1.0"),
        ({"loss": "full_vocab", "cross_tokenizer": True}, "opd.loss", "sampled_token"),
        ({"loss": "cross_vocab"}, "opd.loss", "opd.cross_tokenizer: true"),
        ({"loss": "cross_vocab", "cross_tokenizer": True, "teacher": "endpoint"}, "opd.loss", "use sampled_token"),
    ],
)
def test_objective_constraints_come_from_the_registry(raw, key, fragment, tmp_path, capsys):
    from ars_opd.cli import main
    from ars_opd.lm.opd_objectives import check_config

    cfg = parse_section(SECTIONS["opd"], raw, "opd")  # the section alone parses: the registry decides
    with pytest.raises(ConfigError) as e:
        check_config(cfg)
    assert e.value.key == key and fragment in str(e.value)
    params = committed_params()
    params["opd"].update(raw)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(params))
    assert main(["params", "--file", str(p)]) == 2
    assert key in capsys.readouterr().err


def test_floats_accept_ints_and_tuples_from_lists():
    cfg = parse_section(ModelsConfig, {"teacher_training": {"weight_decay": 1}}, "models")
    assert cfg.teacher_training.weight_decay == 1.0 and isinstance(cfg.teacher_training.weight_decay, float)
    synth = parse_section(SECTIONS["synthetic"], {"tasks": ["add"]}, "synthetic")
    assert synth.tasks == ("add",)


def test_configs_are_frozen():
    cfg = DataConfig()
    with pytest.raises(Exception):
        cfg.subset_size = 3  # type: ignore[misc]
    assert ArchConfig().hidden_size % ArchConfig().num_heads == 0


def test_cli_params_reports_bad_key(tmp_path, capsys):
    from ars_opd.cli import main

    p = _write(tmp_path, "data:\n  subset_sise: 10\n")
    assert main(["params", "--file", str(p)]) == 2
    assert "data.subset_sise" in capsys.readouterr().err


def test_warmup_up_to_steps_is_accepted():
    assert parse_section(SECTIONS["sft"], {"steps": 10, "warmup_steps": 10}, "sft").warmup_steps == 10
    # steps: 0 skips teacher training altogether, whatever the warmup
    assert parse_section(ModelsConfig, {"teacher_training": {"steps": 0}}, "models").teacher_training.steps == 0


@pytest.mark.parametrize(
    "section, raw, stage, needle",
    [
        ("sft", {"steps": 10, "warmup_steps": 30}, "sft", "sft.warmup_steps: must be <= steps (10)"),
        (
            "opd",
            {"loss": "sampled_token", "on_policy_fraction": 0.5},
            "opd",
            "opd.on_policy_fraction: the sampled_token",
        ),
    ],
)
def test_a_stage_prints_a_params_error_alone_and_exits_2(tmp_path, section, raw, stage, needle):
    """The message, not a traceback, as argparse does (also for the OPD objective's check, raised later)."""
    import subprocess
    import sys

    params = committed_params()
    params[section].update(raw)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", f"stages.{stage}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith(f"ars-opd {stage}: invalid params: {needle}") and out.stderr.count("\n") == 1


def _differences_from_defaults(raw: dict, cfg, where: str) -> list[str]:
    """Every key of a params.yaml section ``raw`` (nested sections walked) whose value is not the default in
    ``cfg`` (the section's dataclass built with no arguments), and every field the file leaves out."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(cfg)}
    problems = [
        f"{where}.{name}: not in params.yaml (default {getattr(cfg, name)!r})" for name in sorted(fields - set(raw))
    ]
    for name, value in raw.items():
        if name not in fields:
            problems.append(f"{where}.{name}: no such field")
            continue
        default = getattr(cfg, name)
        if dataclasses.is_dataclass(default):
            problems += _differences_from_defaults(value or {}, default, f"{where}.{name}")
        elif to_dict(default) != value:  # to_dict: tuples as the lists YAML writes
            problems.append(f"{where}.{name}: params.yaml has {value!r}, the dataclass default is {default!r}")
    return problems


def test_every_params_yaml_value_is_its_dataclass_default():
    """One source of defaults: params.yaml is the product's default, so a config built in code (a test, a
    benchmark) or a key left out of a params file runs what the pipeline runs. No exceptions: every field has
    a default (each section builds with no arguments), and paths and inputs are held to it too (dvc.yaml reads
    the same paths from params.yaml: a different default would write elsewhere than DVC tracks). The committed
    file: the workspace's may carry an applied experiment."""
    raw = committed_params()
    problems = [
        p for name, cls in SECTIONS.items() for p in _differences_from_defaults(raw.get(name) or {}, cls(), name)
    ]
    assert problems == [], "\n".join(problems)


@pytest.mark.parametrize(
    "over, sections, key, fragment",
    [
        # the OPD objective's rules (ars_opd.lm.opd_objectives.check_config), as the opd stage loads its sections
        (
            {"opd": {"loss": "sampled_token", "on_policy_fraction": 0.5}},
            ("paths", "models", "ddp", "opd"),
            "opd.on_policy_fraction",
            "sampled from the student",
        ),
        (
            {"opd": {"teacher": "endpoint", "loss": "full_vocab"}},
            ("paths", "models", "ddp", "opd"),
            "opd.loss",
            "full distribution",
        ),
        # the batch split over ddp.workers that every training worker checks (ars_opd.training.batch_plan)
        (
            {"sft": {"global_batch_size": 6, "micro_batch_size": 2}},
            ("paths", "ddp", "sft"),
            "sft.micro_batch_size",
            "does not divide by sft.micro_batch_size = 2",
        ),
        (
            {"ddp": {"workers": 3}},
            ("paths", "ddp", "sft", "opd"),
            "sft.global_batch_size",
            "does not divide by ddp.workers = 3",
        ),
        (
            {"opd": {"global_batch_size": 30}},
            ("paths", "ddp", "sft", "opd"),
            "opd.micro_batch_size",
            "opd.global_batch_size / ddp.workers = 15",
        ),
        ({"control": {"data": "fresh"}}, ("paths", "control"), "control.fresh_rows", "needs rows held back"),
    ],
)
def test_load_params_refuses_what_the_stages_refuse(tmp_path, capsys, over, sections, key, fragment):
    """A stage's checks beyond each section's own run in load_params, so `ars-opd params` and every stage
    refuse the same file, naming the key, before any work starts."""
    from ars_opd.cli import main

    params = committed_params()
    for section, values in over.items():
        params[section].update(values)
    p = tmp_path / "params.yaml"
    p.write_text(yaml.safe_dump(params))
    with pytest.raises(ConfigError) as e:
        load_params(p, sections=sections)
    assert e.value.key == key and fragment in str(e.value)
    assert main(["params", "--file", str(p)]) == 2
    assert key in capsys.readouterr().err


@pytest.mark.parametrize("cross", [False, True])
def test_a_builtin_model_beside_a_pretrained_one_needs_the_cross_tokenizer_flag(cross, tmp_path):
    """Their tokenizers differ by construction: without opd.cross_tokenizer the params are refused, naming the flag."""
    p = _write(
        tmp_path,
        "models:\n  teacher: builtin\n  student: {prune_from: Org/Model, keep_layers: [0, 2]}\n"
        f"opd:\n  cross_tokenizer: {str(cross).lower()}\n  loss: sampled_token\n",
    )
    if cross:
        params = load_params(p, sections=("models", "opd"))
        assert params.models.pruned_student.prune_from == "Org/Model"
    else:
        with pytest.raises(ConfigError) as e:
            load_params(p, sections=("models", "opd"))
        assert e.value.key == "opd.cross_tokenizer" and "cross_tokenizer: true" in str(e.value)
