"""Typed, frozen views of ``params.yaml``: one dataclass per section.

DVC never checks parameter names, so a typo such as ``sft.learning_rat`` would silently run with the
default. Here every section is parsed into a frozen dataclass: unknown keys, wrong types and
out-of-range values are refused with a message that names the full key (``models.teacher_training.lr``)
and what is allowed. Each field carries a one-line docstring (the string after it), which is also the
reference for params.yaml.

One source of defaults: every field's default is the committed params.yaml value (params.yaml is the
product's default), so a config built in code, or a key left out of a params file, runs what the pipeline
runs; tests/test_config.py walks params.yaml key by key against the defaults.

"Valid params" means one thing: ``load_params`` runs every check a stage runs on its params before it starts
work, including those that span sections (what the OPD loss demands of the other ``opd`` keys,
``check_objective`` on ``RULES`` below; the batch split over ``ddp.workers``), so ``ars-opd params``
refuses exactly what a stage would.

What this module leaves out: file paths are not resolved or checked for existence here (stages do that
when they open them), and nothing is read from the environment (but whether this process is a worker of an
outside launcher, whose world ``ddp.workers`` does not describe: ``check_params``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal, Mapping

import yaml

PARAMS_FILE = "params.yaml"

# the training stages, in pipeline order: each has a params section of its own or shares one (sft_continued
# runs OPD's loop on SFT's data), outputs ``paths.<stage>_{model,log,live,checkpoints}`` and a dvc.yaml stage
# running ``python -m stages.<stage>`` (tested). The one list: stages/, checks, evaluate and report derive theirs.
TRAINING_STAGES = ("sft", "opd", "sft_continued")

# the built-in synthetic tasks (``synthetic.tasks`` names some of them); ``ars_opd.data.synthetic`` holds one
# generator and one instruction per name, in this order (tested)
TASK_NAMES = ("add", "reverse", "sort_digits", "length", "uppercase", "count_letter", "running_sum", "shift_steps")
DEFAULT_TASKS = ("add", "reverse", "sort_digits", "length", "uppercase")
# answers of 20-60 tokens written step by step, each step computed from the one before (off by default)
LONG_HORIZON_TASKS = ("running_sum", "shift_steps")


class ConfigError(ValueError):
    """A parameter is unknown, mistyped or out of range. ``key`` is its dotted path."""

    def __init__(self, key: str, message: str):
        self.key, self.message = key, message
        super().__init__(f"{key}: {message}" if key else message)

    def __reduce__(self):
        # a worker's error is pickled to its launcher (ars_opd.training.distributed); the default would
        # rebuild it from the formatted text alone, which __init__ does not take
        return type(self), (self.key, self.message)


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(key, message)


# --------------------------------------------------------------------------------------------------
# sections


@dataclass(frozen=True)
class BaseConfig:
    seed: int = 0
    """Global seed; every stage derives its own random streams from it."""
    threads: int = 2
    """torch CPU threads per process (0 leaves torch's default)."""
    cpu_kernels: Literal["avx2", "native"] = "avx2"
    """Which CPU kernels torch and MKL may use on an x86-64 CPU (``ars_opd.seeding.pin_cpu_kernels``;
    nothing changes on other CPUs or in a GPU's own kernels). The same seeds give other floats when the kernels
    differ, and a thousand training steps carry the difference into every model: the default pipeline made on an
    AMD EPYC with AVX-512 left to its fastest kernels trained a teacher of final loss 0.0056 and students at
    61.5% / 65.5% / 67.0%, where the committed run, made on another AMD EPYC, has 0.0115 and 48.5% / 52.5% /
    51.0%. ``avx2`` caps both at AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS), and the AVX-512 machine then
    reproduced the committed run bit for bit: the run's figures follow its params, not its CPU (checked on these
    two; the same thread count is assumed). The real profile too: capped there, ``make repro-real`` gave its
    committed page (made before the cap) to the last digit, and a pruned-recovery start made by the same stages from
    the same teacher completions came out bit-identical to an earlier start when capped and another model when
    native. bf16 on a CPU (oneDNN's kernels) is not capped: capped, its matmuls ran 100× slower. ``native``: each
    CPU's fastest kernels."""

    def __post_init__(self):
        _require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        _require(self.threads >= 0, "threads", f"must be >= 0, got {self.threads}")


@dataclass(frozen=True)
class PathsConfig:
    """Where stage outputs live. dvc.yaml reads these same values (``${paths.…}``): a path is written once."""

    models_dir: str = "data/models"
    """models stage: teacher/, student/, tokenizer/ and manifest.json."""
    models_metrics: str = "data/metrics/models.json"
    """models stage metrics (teacher held-out accuracy, parameter counts)."""
    subset_train: str = "data/subset/train.jsonl"
    """subset stage: training prompts (one JSON object per line)."""
    subset_eval: str = "data/subset/eval.jsonl"
    """subset stage: held-out evaluation prompts."""
    subset_stats: str = "data/subset/stats.json"
    """subset stage: counts, lengths, malformed rows by reason with examples, provenance."""
    subset_metrics: str = "data/metrics/subset.json"
    """subset stage metrics (row counts), for dvc exp show."""
    teacher_cache: str = "data/teacher_cache/answers.jsonl"
    """teacher_gen: the sha256-keyed answer cache (a persistent DVC out: it survives reruns)."""
    teacher_refusals: str = "data/teacher_cache/refusals.jsonl"
    """teacher_gen: requests whose failure a rerun cannot change (400/413/422, empty greedy answers); persistent."""
    teacher_failure_report: str = "data/teacher_cache/last_run_failures.json"
    """teacher_gen: the last run's failures grouped by reason, written even when the stage fails (not a DVC out)."""
    teacher_dir: str = "data/teacher"
    """teacher_gen: train.jsonl / eval.jsonl (prompts joined to completions), failures.jsonl, manifest.json."""
    teacher_metrics: str = "data/metrics/teacher_gen.json"
    """teacher_gen metrics (counts, failures by reason, throughput)."""
    sft_model: str = "data/sft/model"
    """sft: the trained student (HF directory); the only sft output later stages read."""
    sft_log: str = "data/sft/log"
    """sft: steps.jsonl (per-step, per-worker log, no wall-clock columns) and manifest.json."""
    sft_live: str = "data/live/sft"
    """sft: DVCLive directory (metrics.json for dvc exp show, plots/ for dvc plots)."""
    sft_checkpoints: str = "data/checkpoints/sft"
    """sft: resumable checkpoints (a persistent DVC out)."""
    stage_runs: str = "data/logs/stage_runs.jsonl"
    """Every stage run's wall time and its process tree's peak memory, one JSON line each (``ars_opd.resources``;
    not a DVC output: a record of runs)."""
    distill_init: str = "data/sft/model"
    """The student opd starts from: the sft stage's model by default; a fixed copy for a study that varies the
    sft stage but must not let that vary opd's starting point."""
    sft_continued_model: str = "data/sft_continued/model"
    """sft_continued (OPD's control arm: more SFT from the same start, OPD's loop): the student."""
    sft_continued_log: str = "data/sft_continued/log"
    """sft_continued: steps.jsonl and manifest.json."""
    sft_continued_live: str = "data/live/sft_continued"
    """sft_continued: DVCLive directory."""
    sft_continued_checkpoints: str = "data/checkpoints/sft_continued"
    """sft_continued: resumable checkpoints (a persistent DVC out)."""
    opd_model: str = "data/opd/model"
    """opd: the distilled student (HF directory)."""
    opd_log: str = "data/opd/log"
    """opd: steps.jsonl and manifest.json."""
    opd_live: str = "data/live/opd"
    """opd: DVCLive directory."""
    opd_checkpoints: str = "data/checkpoints/opd"
    """opd: resumable checkpoints (a persistent DVC out)."""
    eval_dir: str = "data/evaluate"
    """evaluate: table.md, answers.jsonl (every greedy answer), manifest.json."""
    eval_metrics: str = "data/metrics/evaluate.json"
    """evaluate metrics, nested by model (base, sft, opd, sft_continued, teacher)."""
    eval_live: str = "data/live/evaluate"
    """evaluate: the learning curves through DVCLive (plots/metrics/<stage>/<metric>.tsv against steps)."""
    report_md: str = "reports/report.md"
    """report: the markdown report."""
    report_figures: str = "reports/figures"
    """report: PNG figures."""
    report_plots: str = "reports/plots"
    """report: per-step CSV series (dvc plots)."""
    report_metrics: str = "reports/metrics.json"
    """report: flat metrics for dvc exp show."""
    detection_benchmark: str = "reports/detection.jsonl"
    """studies/detection.py's committed output, which the report quotes (false-alarm rate, detection delays)."""
    distillation_study: str = "reports/distillation.md"
    """The seed study's file (``ars-opd distillation --out``); the report quotes its long-horizon section's
    measurement of the regime where OPD is expected to win."""

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            _require(bool(value.strip()), f.name, "must be a non-empty path")
            _require(not Path(value).is_absolute(), f.name, f"must be relative to the repo root, got {value!r}")

    def completions(self, split: str) -> str:
        """teacher_gen's prompts joined to completions for ``split`` (train or eval)."""
        if split not in ("train", "eval"):
            raise ValueError(f"split must be train or eval, got {split!r}")
        return str(Path(self.teacher_dir) / f"{split}.jsonl")

    def training(self, stage: str) -> "TrainingPaths":
        """The outputs of a training stage (one of ``TRAINING_STAGES``)."""
        return TrainingPaths(*(getattr(self, f"{stage}_{part}") for part in TrainingPaths._fields))


class TrainingPaths(typing.NamedTuple):
    model: str
    log: str
    live: str
    checkpoints: str

    @property
    def steps(self) -> str:
        """The per-step log (one JSON line per step, per-worker columns, no wall-clock columns)."""
        return str(Path(self.log) / "steps.jsonl")

    @property
    def manifest(self) -> str:
        """Counts, batch geometry, resume point and provenance of the run."""
        return str(Path(self.log) / "manifest.json")


@dataclass(frozen=True)
class SyntheticConfig:
    """The built-in synthetic instruction tasks (used by the built-in teacher and by ``data.source: synthetic``)."""

    tasks: tuple[str, ...] = DEFAULT_TASKS
    """Task names, drawn uniformly; allowed: add, reverse, sort_digits, length, uppercase, count_letter, and
    the long-horizon family running_sum, shift_steps (answers of 20-60 tokens; see ``ars_opd.data.synthetic``)."""
    max_operand: int = 19
    """add: operands are drawn from 0..max_operand."""
    min_len: int = 3
    """Shortest letter/digit string in reverse, sort_digits, length, uppercase and count_letter."""
    max_len: int = 5
    """Longest letter/digit string."""

    def __post_init__(self):
        _require(len(self.tasks) > 0, "tasks", f"must name at least one task; allowed: {list(TASK_NAMES)}")
        for t in self.tasks:
            _require(t in TASK_NAMES, "tasks", f"unknown task {t!r}; allowed: {list(TASK_NAMES)}")
        _require(len(set(self.tasks)) == len(self.tasks), "tasks", "lists a task twice")
        _require(0 < self.max_operand <= 10**6, "max_operand", f"must be in 1..1000000, got {self.max_operand}")
        _require(1 <= self.min_len <= 64, "min_len", f"must be in 1..64, got {self.min_len}")
        _require(self.min_len <= self.max_len <= 64, "max_len", f"must be in min_len..64, got {self.max_len}")


@dataclass(frozen=True)
class ArchConfig:
    """Shape of a model built from config (built-in default only)."""

    family: Literal["llama", "qwen3"] = "llama"
    """Architecture family of the transformers config class used."""
    hidden_size: int = 128
    """Model width."""
    num_layers: int = 4
    """Transformer blocks."""
    num_heads: int = 4
    """Attention heads; hidden_size must divide by it."""
    num_kv_heads: int = 4
    """Key/value heads (grouped-query attention); num_heads must divide by it."""
    intermediate_size: int = 512
    """MLP width."""
    max_position_embeddings: int = 256
    """Longest sequence the rotary embedding is configured for."""
    tie_word_embeddings: bool = True
    """Share input embedding and output projection."""

    def __post_init__(self):
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            _require(getattr(self, name) > 0, name, f"must be > 0, got {getattr(self, name)}")
        _require(
            self.hidden_size % self.num_heads == 0,
            "num_heads",
            f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}",
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"num_heads {self.num_heads} is not divisible by num_kv_heads {self.num_kv_heads}",
        )
        _require(
            16 <= self.max_position_embeddings <= 1 << 20,
            "max_position_embeddings",
            f"must be in 16..1048576, got {self.max_position_embeddings}",
        )


@dataclass(frozen=True)
class OptimConfig:
    """AdamW, warmup + cosine learning rate, gradient clipping: shared by every training loop."""

    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 20
    """Linear warmup steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak (cosine decay)."""
    weight_decay: float = 0.01
    """AdamW weight decay (matrices only)."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.95
    """AdamW beta2."""
    adam_eps: float = 1e-8
    """AdamW epsilon."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; null = noclip (the pre-clip norm is logged either way)."""

    def __post_init__(self):
        _require(0 < self.lr < 1, "lr", f"must be in (0, 1), got {self.lr}")
        _require(self.warmup_steps >= 0, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _require(self.weight_decay >= 0, "weight_decay", f"must be >= 0, got {self.weight_decay}")
        _require(0 <= self.adam_beta1 < 1, "adam_beta1", f"must be in [0, 1), got {self.adam_beta1}")
        _require(0 <= self.adam_beta2 < 1, "adam_beta2", f"must be in [0, 1), got {self.adam_beta2}")
        _require(self.adam_eps > 0, "adam_eps", f"must be > 0, got {self.adam_eps}")
        _require(
            self.max_grad_norm is None or self.max_grad_norm > 0,
            "max_grad_norm",
            f"must be > 0, or null for no clipping, got {self.max_grad_norm}",
        )


@dataclass(frozen=True)
class TeacherTrainingConfig(OptimConfig):
    """How the models stage trains the built-in teacher on the synthetic tasks (single process)."""

    steps: int = 1500
    """Optimizer steps (a step count, not a time budget, so the result is deterministic)."""
    batch_size: int = 64
    """Sequences per step."""
    warmup_steps: int = 100
    """Linear warmup steps before the cosine decay."""
    eval_examples: int = 500
    """Held-out synthetic prompts for the teacher's exact-match accuracy."""
    min_accuracy: float = 0.85
    """Fail the stage if held-out exact match is below this (0 disables the gate)."""

    def __post_init__(self):
        super().__post_init__()
        _require(self.steps >= 0, "steps", f"must be >= 0, got {self.steps}")
        _require(
            self.steps == 0 or self.warmup_steps <= self.steps,
            "warmup_steps",
            f"must be <= steps ({self.steps}), got {self.warmup_steps}: the learning rate would never reach "
            "its peak; lower warmup_steps or raise steps",
        )
        _require(self.batch_size > 0, "batch_size", f"must be > 0, got {self.batch_size}")
        _require(self.eval_examples > 0, "eval_examples", f"must be > 0, got {self.eval_examples}")
        _require(0 <= self.min_accuracy <= 1, "min_accuracy", f"must be in [0, 1], got {self.min_accuracy}")


BUILTIN = "builtin"


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    """A parameter-efficient adapter on the student (peft), trained instead of the full weights."""

    kind: Literal["lora"] | None = None
    """null: full fine-tuning; lora: train a LoRA adapter (peft) on the frozen student."""
    r: int = 16
    """LoRA rank."""
    alpha: float = 32.0
    """LoRA scale numerator: the update is (alpha / r)·B·A."""
    dropout: float = 0.0
    """Dropout on the adapter's input (0: none; the trained model is then deterministic given the data)."""
    target_modules: tuple[str, ...] = LORA_TARGETS
    """Linear layers to adapt, by name or dotted-name suffix (peft's rule); each must match a module."""
    modules_to_save: tuple[str, ...] = ()
    """Modules trained whole beside the adapter (peft's modules_to_save), by name or dotted-name suffix, e.g.
    [embed_tokens]; an output head tied to a trained embedding follows it (the built-in student's is tied).
    Empty: the adapter only, so a frozen tied head keeps the base's output distribution."""

    def __post_init__(self):
        _require(self.r >= 1, "r", f"must be >= 1, got {self.r}")
        _require(self.alpha > 0, "alpha", f"must be > 0, got {self.alpha}")
        _require(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        _require(
            len(self.target_modules) > 0 and all(t.strip() for t in self.target_modules),
            "target_modules",
            "must name at least one module",
        )
        _require(all(m.strip() for m in self.modules_to_save), "modules_to_save", "has an empty module name")
        both = sorted(set(self.modules_to_save) & set(self.target_modules))
        _require(not both, "modules_to_save", f"{both} also in target_modules: a module is adapted or trained whole")

    @property
    def enabled(self) -> bool:
        return self.kind is not None


GGUF_SUFFIX = ".gguf"
# how a pruned student chooses the teacher layers it keeps (besides an explicit list of indices)
PRUNE_RULES = ("every_other", "deep_block")


def is_gguf(name: str) -> bool:
    """A model param naming a GGUF file (llama.cpp's single-file format), by its suffix."""
    return name.lower().endswith(GGUF_SUFFIX)


@dataclass(frozen=True)
class PrunedStudentConfig:
    """A student made from the teacher by keeping some of its decoder layers (depth pruning), the way real small
    models are made (Minitron prunes, then recovers the model by distillation). It shares the teacher's
    tokenizer, embeddings and head by construction."""

    prune_from: str = "teacher"
    """The model whose layers are kept: 'teacher' (the models stage's teacher), or another pretrained model (a hub
    id, a local directory or a .gguf file), pinned like a teacher, e.g. for a student whose tokenizer is not the
    teacher's (``opd.cross_tokenizer``)."""
    keep_layers: str | tuple[int, ...] = "every_other"
    """every_other: teacher layers 0, 2, 4, ...; deep_block: the first num_layers - 1 layers and the last one
    (drop one contiguous block of deep layers, which Gromov et al. 2024 and ShortGPT find less destructive than
    spreading the cut); or an explicit increasing list of teacher layer indices (0-based)."""
    num_layers: int | None = None
    """Layers the student keeps under deep_block (null: half the teacher's, rounded up); every_other implies it
    and an explicit list is its own count, so set it only for deep_block."""

    def __post_init__(self):
        _require(
            bool(self.prune_from.strip()) and self.prune_from != BUILTIN,
            "prune_from",
            f"must be 'teacher' or a pretrained model (hub id, local directory or .gguf file), got {self.prune_from!r}",
        )
        if isinstance(self.keep_layers, str):
            _require(
                self.keep_layers in PRUNE_RULES,
                "keep_layers",
                f"must be one of {list(PRUNE_RULES)} or a list of layer indices, got {self.keep_layers!r}",
            )
        else:
            layers = list(self.keep_layers)
            _require(len(layers) > 0, "keep_layers", "must keep at least one layer")
            _require(min(layers) >= 0, "keep_layers", f"layer indices are 0-based, got {layers}")
            _require(
                all(a < b for a, b in zip(layers, layers[1:])),
                "keep_layers",
                f"must be strictly increasing (each layer once, in the teacher's order), got {layers}",
            )
        _require(
            self.num_layers is None or self.keep_layers == "deep_block",
            "num_layers",
            "only deep_block takes a layer count (every_other keeps half, a list is its own count); set it to null",
        )
        _require(
            self.num_layers is None or self.num_layers >= 2,
            "num_layers",
            f"deep_block keeps the first num_layers - 1 layers and the last: at least 2, got {self.num_layers}",
        )

    def layers(self, teacher_layers: int) -> list[int]:
        """The teacher layers kept, for a teacher of ``teacher_layers`` decoder layers (``ConfigError`` when the
        choice does not fit it)."""
        if self.keep_layers == "every_other":
            kept = list(range(0, teacher_layers, 2))
        elif self.keep_layers == "deep_block":
            n = self.num_layers if self.num_layers is not None else (teacher_layers + 1) // 2
            _require(n <= teacher_layers, "num_layers", f"{n} is more than the teacher's {teacher_layers} layers")
            kept = list(range(n - 1)) + [teacher_layers - 1]
        else:
            kept = list(self.keep_layers)
            _require(
                kept[-1] < teacher_layers,
                "keep_layers",
                f"names layer {kept[-1]}, but the teacher has {teacher_layers} (0..{teacher_layers - 1})",
            )
        _require(
            len(kept) < teacher_layers,
            "keep_layers",
            f"keeps all {teacher_layers} teacher layers: that is the teacher, not a pruned student",
        )
        return kept


@dataclass(frozen=True)
class ModelsConfig:
    """Teacher and student: the built-in tiny models, or pretrained ones (hub id, local directory or GGUF file),
    and a student that may be pruned from the teacher."""

    teacher: str = BUILTIN
    """'builtin', a hub id such as Qwen/Qwen3-1.7B, a local model directory, or a local .gguf file (converted by
    the models stage into a plain fp32 HF directory that every later stage and vLLM read)."""
    student: str | PrunedStudentConfig = BUILTIN
    """'builtin', a hub id such as Qwen/Qwen3-0.6B, a local model directory or .gguf file, or a mapping
    {prune_from: teacher, keep_layers: every_other | deep_block | [indices], num_layers} for a student made of
    some of the teacher's layers."""
    teacher_revision: str | None = None
    """Hub revision (branch, tag or commit) of a hub teacher; resolved to a commit hash in the manifest."""
    student_revision: str | None = None
    """Hub revision of a hub student."""
    trust_remote_code: bool = False
    """Allow model code from the hub to run (off: only architectures transformers ships)."""
    teacher_arch: ArchConfig = field(default_factory=ArchConfig)
    """Built-in teacher shape."""
    student_arch: ArchConfig = field(
        default_factory=lambda: ArchConfig(
            hidden_size=96, num_layers=2, num_heads=3, num_kv_heads=3, intermediate_size=384
        )
    )
    """Built-in student shape (smaller than the teacher; head_dim 32, which vLLM's CPU attention serves)."""
    teacher_training: TeacherTrainingConfig = field(default_factory=TeacherTrainingConfig)
    """Training of the built-in teacher."""
    student_adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """What the training stages train: the whole student (kind: null) or an adapter on it; the teacher is never
    adapted. Read by sft, opd and sft_continued only (the models stage ignores it)."""

    def __post_init__(self):
        _require(bool(self.teacher.strip()), "teacher", "must be 'builtin', a hub id, a local directory or .gguf file")
        for role in ("teacher", "student"):
            name = getattr(self, role)
            _require(
                not (isinstance(name, str) and is_gguf(name) and getattr(self, f"{role}_revision") is not None),
                f"{role}_revision",
                f"a .gguf file is pinned by its sha256, it has no revisions: set {role}_revision to null",
            )
        if isinstance(self.student, PrunedStudentConfig):
            _require(
                self.student_revision is None,
                "student_revision",
                "a pruned student is pinned by its source (teacher_revision for the teacher); set it to null",
            )
            return
        _require(bool(self.student.strip()), "student", "must be 'builtin', a hub id, a local directory or .gguf file")

    @property
    def mixed_builtin(self) -> bool:
        """One side is the built-in model and the other a pretrained one: their tokenizers differ, which only
        ``opd.cross_tokenizer`` allows (``check_params``)."""
        pruned = self.pruned_student
        student_builtin = self.student == BUILTIN or (
            pruned is not None and pruned.prune_from == "teacher" and self.teacher == BUILTIN
        )
        return (self.teacher == BUILTIN) != student_builtin

    @property
    def pruned_student(self) -> PrunedStudentConfig | None:
        """The pruning recipe when the student is made from the teacher, else None."""
        return self.student if isinstance(self.student, PrunedStudentConfig) else None


@dataclass(frozen=True)
class DataConfig:
    """The instruction dataset and its subset."""

    source: str = "synthetic"
    """'synthetic', a local .json/.jsonl/.parquet/.csv file or saved dataset directory, or a hub dataset id."""
    format: Literal["auto", "alpaca", "messages", "prompt_response", "sharegpt"] = "auto"
    """Row format; 'auto' detects it per row from the fields present."""
    hub_config: str | None = None
    """Dataset configuration name for a hub dataset."""
    hub_split: str = "train"
    """Split to read from a hub dataset or saved dataset directory."""
    hub_revision: str | None = None
    """Dataset revision for a hub dataset."""
    subset_size: int = 2200
    """Rows to keep (train + eval). For 'synthetic' this many rows are generated; 0 keeps all valid rows."""
    eval_size: int = 200
    """Rows of the subset held out for evaluation."""
    max_malformed_fraction: float = 0.05
    """Fail if more than this fraction of the rows examined is malformed."""
    drop_duplicates: bool = True
    """Drop rows whose prompt and response repeat an earlier row."""
    system_prompt: str | None = None
    """If set, a system message prepended to every prompt."""

    def __post_init__(self):
        _require(bool(self.source.strip()), "source", "must be 'synthetic', a file, a directory or a hub id")
        _require(self.subset_size >= 0, "subset_size", f"must be >= 0, got {self.subset_size}")
        _require(self.eval_size >= 0, "eval_size", f"must be >= 0, got {self.eval_size}")
        if self.subset_size:
            _require(
                self.eval_size < self.subset_size,
                "eval_size",
                f"must be smaller than subset_size ({self.subset_size}), got {self.eval_size}",
            )
        _require(
            0 <= self.max_malformed_fraction <= 1,
            "max_malformed_fraction",
            f"must be in [0, 1], got {self.max_malformed_fraction}",
        )
        if self.source == "synthetic":
            _require(self.subset_size > 0, "subset_size", "must be > 0 for the synthetic source")


INPUT_PLACEHOLDER = "inputs/none"
LOCAL_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


@dataclass(frozen=True)
class InputsConfig:
    """User-provided local files that DVC must hash: each value is a dep of the stage that reads it.

    DVC tracks only what dvc.yaml lists, and cannot make a dep conditional (a dep that does not exist
    fails the run), so ``data.source`` and ``models.teacher``/``student`` cannot be deps themselves: they
    may be 'synthetic', 'builtin' or a hub id. Here each is mirrored as a path that always exists: the
    local file or directory, or the committed placeholder ``inputs/none``. Validated against the source
    keys (``check_inputs``), so a local source can never go untracked.
    """

    data: str = INPUT_PLACEHOLDER
    """data.source when it is a local file or directory (a dep of subset), else inputs/none."""
    teacher: str = INPUT_PLACEHOLDER
    """models.teacher when it is a local model directory or .gguf file (a dep of models), else inputs/none."""
    student: str = INPUT_PLACEHOLDER
    """models.student when it is a local model directory or .gguf file (a dep of models), else inputs/none (a
    pruned student too: the teacher's file is its dep)."""
    teachers: str = INPUT_PLACEHOLDER
    """A directory holding every local directory or .gguf file that teachers.named names (a dep of models: DVC
    cannot take a list of deps from params, so the named teachers' local files share one), else inputs/none."""

    def __post_init__(self):
        for role in ("data", "teacher", "student", "teachers"):
            value = getattr(self, role)
            _require(bool(value.strip()), role, f"must be a local path or {INPUT_PLACEHOLDER!r}")
            _require(
                not value.startswith("~"),
                role,
                f"DVC does not expand '~': write the full path {str(Path(value).expanduser())!r}",
            )


def _looks_local(value: str, path_like: bool, base: Path) -> Path | None:
    """``value`` as a local path (relative to ``base``) if it exists or is written like a path, else None."""
    p = Path(value).expanduser()
    p = p if p.is_absolute() else base / p
    return p if p.exists() or path_like else None


def check_inputs(
    inputs: InputsConfig, data: DataConfig | None, models: ModelsConfig | None, base: str | Path = "."
) -> None:
    """Each local source is mirrored by its ``inputs`` key, and nothing else is; ``ConfigError`` names both
    keys and the line to write. ``base``: the directory relative paths start from (the repository root)."""
    base = Path(base).resolve()
    pairs = []
    if data is not None:
        path_like = data.source.startswith((".", "/", "~")) or Path(data.source).suffix.lower() in LOCAL_DATA_SUFFIXES
        local = None if data.source == "synthetic" else _looks_local(data.source, path_like, base)
        pairs.append(("data", "data.source", data.source, local, "subset"))
    if models is not None:
        for role in ("teacher", "student"):
            name = getattr(models, role)
            if not isinstance(name, str):  # a pruned student
                if name.prune_from == "teacher":  # made of the teacher's layers: no file of its own
                    pairs.append((role, f"models.{role}", "a pruned student", None, "models"))
                    continue
                name, source_key = name.prune_from, f"models.{role}.prune_from"  # pinned from a source of its own
                path_like = name.startswith((".", "/", "~")) or name.count("/") > 1 or is_gguf(name)
                pairs.append((role, source_key, name, _looks_local(name, path_like, base), "models"))
                continue
            path_like = name.startswith((".", "/", "~")) or name.count("/") > 1 or is_gguf(name)
            local = None if name == BUILTIN else _looks_local(name, path_like, base)
            pairs.append((role, f"models.{role}", name, local, "models"))
    for key, source_key, source, local, stage in pairs:
        value = getattr(inputs, key)
        if local is None:
            _require(
                value == INPUT_PLACEHOLDER,
                f"inputs.{key}",
                f"{source_key} is {source!r}, not a local file or directory, so there is nothing for DVC to "
                f"hash: set inputs.{key}: {INPUT_PLACEHOLDER} (got {value!r})",
            )
            continue
        _require(local.exists(), source_key, f"no such file or directory: {source!r}")
        mirrored = Path(value) if Path(value).is_absolute() else base / value
        _require(
            value != INPUT_PLACEHOLDER and mirrored.resolve() == local.resolve(),
            f"inputs.{key}",
            f"{source_key} is the local path {source!r}, which DVC must hash so that `dvc status` reports the "
            f"{stage} stage as changed when it changes: set inputs.{key}: {str(Path(source).expanduser())!r} "
            f"(got {value!r})",
        )


LOCAL_ENDPOINT = "local"
VLLM_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype choices


@dataclass(frozen=True)
class TeacherServerConfig:
    """The bundled local server (``teacher_gen.endpoint: local``)."""

    max_batch_size: int = 64
    """Most requests batched into one generate call."""
    max_wait_ms: float = 5.0
    """How long the first request of a batch waits for company (again while more arrive and less than a batch
    waits, 20 times at most)."""
    max_batch_tokens: int | None = None
    """Most token budget per generate call: rows × their longest max_tokens, what a batch costs since it runs
    until its longest row ends (null: max_batch_size alone; a single row always runs)."""
    max_queue_fraction: float | None = None
    """Answer 429 with Retry-After when a request's estimated wait for its answer exceeds this fraction of the
    client's request_timeout_s, passed by the stage that starts the server (teacher_gen); null: never."""
    threads: int = 2
    """torch CPU threads of the server process."""
    startup_timeout_s: float = 180.0
    """Give up if the server is not ready after this long."""

    def __post_init__(self):
        _require(self.max_batch_size > 0, "max_batch_size", f"must be > 0, got {self.max_batch_size}")
        _require(self.max_wait_ms >= 0, "max_wait_ms", f"must be >= 0, got {self.max_wait_ms}")
        _require(
            self.max_batch_tokens is None or self.max_batch_tokens > 0,
            "max_batch_tokens",
            f"must be null or > 0, got {self.max_batch_tokens}",
        )
        _require(
            self.max_queue_fraction is None or 0 < self.max_queue_fraction <= 1,
            "max_queue_fraction",
            f"must be null or in (0, 1], got {self.max_queue_fraction}",
        )
        _require(self.threads >= 0, "threads", f"must be >= 0, got {self.threads}")
        _require(self.startup_timeout_s > 0, "startup_timeout_s", f"must be > 0, got {self.startup_timeout_s}")


@dataclass(frozen=True)
class RolloutEngineConfig:
    """The inference engine that samples OPD's rollouts (``opd.rollouts: engine``; ``ars_opd.rollouts``)."""

    server: str = "bundled"
    """bundled (our server, started for the stage), vllm (a real vLLM from .venv-vllm or $ARS_OPD_VLLM_PYTHON,
    started for the stage) or the http(s) base URL of a running server started with our worker extension."""
    model: str = "student"
    """Served model name (the name the started engines register; for a URL, the name it serves)."""
    sync_every: int = 1
    """Publish the trainer's weights to the engine every this many optimizer steps, and sooner whenever a step's
    rollouts would otherwise be more than max_lag versions old (so a version lasts min(sync_every, max_lag + 1)
    steps; 1: every step)."""
    transport: Literal["filesystem", "nccl"] = "filesystem"
    """filesystem: rank 0 writes safetensors the engine reloads; nccl: rank 0 broadcasts them into a CUDA vLLM
    through vLLM's weight-transfer routes (``ars_opd.rollouts.nccl_sync``; the trainer on CUDA, not the bundled
    engine)."""
    sync_dir: str | None = None
    """Where versions are written (must be readable by the engine); null: <checkpoint dir>/engine-sync."""
    max_lag: int = 0
    """Rollouts of step s come from weights of version s - max_lag at the oldest: 0 (synchronous), 1 or 2."""
    concurrency: int = 16
    """Rollout requests in flight per worker (one request per prompt)."""
    request_timeout_s: float = 300.0
    """Per-request timeout."""
    max_attempts: int = 3
    """Attempts per request (a dead engine is never retried)."""
    probe_tokens: int = 32
    """Length of the fixed probe sequence the engine scores after every sync."""
    probe_tolerance: float | None = None
    """Largest |engine - trainer| log-probability on the probe, τ (an engine outside the fp32 rounding model,
    bf16); null: calibrated at the first sync, τ = min(derived fp32 bound, max(probe_margin x d0, floor))."""
    probe_calibration: int = 4
    """Distinct probe sequences the engine scores at the first sync; d0, their largest |engine - trainer|, is
    what two computations of the same weights differ by on this engine's kernels."""
    probe_margin: float = 8.0
    """τ = probe_margin x d0 (within the derived bound, at least a few dozen roundings of the largest logit):
    room for later syncs' roundings to land above the calibration's largest."""
    indistinguishable: Literal["warn", "refuse"] = "warn"
    """When an update moves the probe by at most 2 τ and the fingerprint did not verify every tensor, a stale
    engine would pass: refuse stops the stage with one line, warn logs it (the indistinguishable column)."""
    dlogp_check: Literal["refuse", "warn"] = "refuse"
    """At lag 0 the engine sampled with the weights just verified, so the step's mean |log q_engine - log
    q_trainer| of its trained tokens is rounding and must be within the probe's tolerance τ; past it (an engine
    restarted between syncs, stale in its decode path or its prefix cache): refuse stops the stage before the
    step's update, warn logs it. Lag >= 1 (the policy's drift) and a bf16 or dropout training forward: logged only."""
    fingerprint: bool = True
    """After every load, compare the sha256 of each tensor the engine computes with (in the trainer's names)
    with the published one, and refuse a mismatch by name; false: the probe alone (an engine whose hashing is
    too slow: it reads every weight, about a second per 100M parameters on one CPU core)."""
    max_importance_weight: float = 2.0
    """Truncation c of the importance weight min(c, q_now / q_sampler) of sampled_token under max_lag >= 1."""
    max_model_len: int | None = None
    """Context length a started vLLM reserves per sequence; null: what the stage asks for, max_prompt_tokens +
    max_new_tokens (or probe_tokens + 1 if longer), at most the student's max_position_embeddings (a real
    student's full context, 40,960 for Qwen3, is more KV cache than a GPU gives and vLLM refuses to start)."""
    build: Literal["auto", "cpu", "gpu"] = "auto"
    """Which vLLM a started engine is (its environment: .venv-vllm or $ARS_OPD_VLLM_PYTHON); auto: ask that
    environment's python whether its torch sees a GPU. It decides the launch settings left null below."""
    dtype: str | None = None
    """A started vLLM's --dtype (auto, float32, bfloat16, float16, ...); null: float32 on a CPU build (the
    trainer's precision, the version check's derived fp32 bound), auto on a GPU build (the checkpoint's dtype,
    bf16 for fp32 weights; refused while probe_tolerance is null, whose first sync holds to the fp32 bound)."""
    enforce_eager: bool | None = None
    """A started vLLM's --enforce-eager; null: on a CPU build (no torch.compile: a quick start), off on a GPU
    build (CUDA graphs)."""
    gpu_memory_utilization: float = 0.4
    """A started GPU vLLM's share of the GPU's memory (weights, activations and KV cache); less than vLLM's 0.9
    because the training workers start after it on the same GPUs. Not used by a CPU build (a 256 MiB KV cache)."""
    cpus: str | None = None
    """A started CPU vLLM's cores (VLLM_CPU_OMP_THREADS_BIND, e.g. "0"); null: vLLM's choice."""
    startup_timeout_s: float = 300.0
    """Give up if a started engine is not ready after this long."""
    bundled: TeacherServerConfig = field(default_factory=lambda: TeacherServerConfig(threads=1))
    """The bundled engine's batching and threads (one: it shares the machine with the training workers)."""

    def __post_init__(self):
        _require(
            self.server in ("bundled", "vllm") or self.server.startswith(("http://", "https://")),
            "server",
            f"must be bundled, vllm or an http(s) base URL, got {self.server!r}",
        )
        _require(bool(self.model), "model", "must name the served model")
        _require(self.sync_every >= 1, "sync_every", f"must be >= 1, got {self.sync_every}")
        _require(self.max_lag in (0, 1, 2), "max_lag", f"must be 0, 1 or 2, got {self.max_lag}")
        _require(1 <= self.concurrency <= 4096, "concurrency", f"must be in 1..4096, got {self.concurrency}")
        _require(self.request_timeout_s > 0, "request_timeout_s", f"must be > 0, got {self.request_timeout_s}")
        _require(self.max_attempts >= 1, "max_attempts", f"must be >= 1, got {self.max_attempts}")
        _require(self.probe_tokens >= 2, "probe_tokens", f"must be >= 2, got {self.probe_tokens}")
        _require(
            self.probe_tolerance is None or self.probe_tolerance > 0,
            "probe_tolerance",
            f"must be > 0 or null, got {self.probe_tolerance}",
        )
        _require(self.probe_calibration >= 1, "probe_calibration", f"must be >= 1, got {self.probe_calibration}")
        _require(self.probe_margin >= 1, "probe_margin", f"must be >= 1, got {self.probe_margin}")
        _require(
            self.indistinguishable in ("warn", "refuse"),
            "indistinguishable",
            f"must be warn or refuse, got {self.indistinguishable!r}",
        )
        _require(
            self.dlogp_check in ("refuse", "warn"), "dlogp_check", f"must be refuse or warn, got {self.dlogp_check!r}"
        )
        _require(self.max_importance_weight >= 1, "max_importance_weight", "must be >= 1")
        _require(
            self.max_model_len is None or self.max_model_len > 0,
            "max_model_len",
            f"must be > 0, got {self.max_model_len}",
        )
        _require(self.build in ("auto", "cpu", "gpu"), "build", f"must be auto, cpu or gpu, got {self.build!r}")
        _require(
            self.dtype in (None, *VLLM_DTYPES),
            "dtype",
            f"must be null or one of {', '.join(VLLM_DTYPES)}, got {self.dtype!r}",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        _require(
            not (self.transport == "nccl" and self.server == "bundled"),
            "transport",
            "nccl is vLLM's weight transfer on GPUs; the bundled engine loads files: use filesystem, or "
            "server: vllm (or the URL of a CUDA vLLM)",
        )


@dataclass(frozen=True)
class EndpointConfig:
    """An OpenAI-compatible endpoint, and how the client talks to it (bounded concurrency, retries)."""

    endpoint: str = LOCAL_ENDPOINT
    """'local' (start the bundled server for the models-stage teacher) or a base URL such as http://localhost:8000/v1."""
    model: str | None = None
    """Model name at the endpoint (required unless endpoint is 'local')."""
    api_key_env: str | None = None
    """Name of the environment variable holding the API key (the key itself never goes in params)."""
    concurrency: int = 32
    """Requests in flight at once."""
    request_timeout_s: float = 60.0
    """Per-request timeout."""
    max_attempts: int = 5
    """Attempts per request, first included."""
    backoff_base_s: float = 0.5
    """First retry waits about this long; doubles each attempt (with jitter)."""
    backoff_max_s: float = 30.0
    """Longest backoff between attempts."""
    auto_concurrency: ClassVar[bool] = False  # whether concurrency may be null (derived at run time)

    def __post_init__(self):
        local = self.endpoint == LOCAL_ENDPOINT
        _require(
            local or self.endpoint.startswith(("http://", "https://")),
            "endpoint",
            f"must be 'local' or an http(s) base URL, got {self.endpoint!r}",
        )
        _require(local or bool(self.model), "model", "must name the model when endpoint is a URL")
        auto = " or null" if self.auto_concurrency else ""
        _require(
            (self.concurrency is None and self.auto_concurrency)
            or (self.concurrency is not None and 1 <= self.concurrency <= 4096),
            "concurrency",
            f"must be in 1..4096{auto}, got {self.concurrency}",
        )
        _require(self.request_timeout_s > 0, "request_timeout_s", f"must be > 0, got {self.request_timeout_s}")
        _require(self.max_attempts >= 1, "max_attempts", f"must be >= 1, got {self.max_attempts}")
        _require(self.backoff_base_s >= 0, "backoff_base_s", f"must be >= 0, got {self.backoff_base_s}")
        _require(self.backoff_max_s >= self.backoff_base_s, "backoff_max_s", "must be >= backoff_base_s")
        if self.api_key_env is not None:
            _require(
                self.api_key_env.replace("_", "").isalnum(),
                "api_key_env",
                "must be the *name* of an environment variable (letters, digits, _), never the key itself",
            )


@dataclass(frozen=True)
class TeacherGenConfig(EndpointConfig):
    """Asking the teacher for a completion of every prompt."""

    concurrency: int | None = None
    """Requests in flight at once; null: derived when the stage runs and recorded in its manifest (endpoint
    local: two of the bundled server's batches of max_tokens answers, one running and one waiting; a URL: 32)."""
    auto_concurrency: ClassVar[bool] = True
    model_revision: str | None = None
    """Identifies the remote model's weights in cache keys (set it when the endpoint's model changes under one name)."""
    splits: tuple[Literal["train", "eval"], ...] = ("train", "eval")
    """Subset splits to complete (eval completions feed the evaluate stage)."""
    temperature: float = 0.0
    """Sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    max_tokens: int = 32
    """Most completion tokens per answer."""
    seed: int | None = None
    """Sampling seed sent with each request (null: none)."""
    stop: tuple[str, ...] = ()
    """Stop strings."""
    system_prompt: str | None = None
    """System message prepended to prompts that have none."""
    strip_thinking: bool = True
    """Remove a leading <think>...</think> block from training text (the cache keeps the raw answer)."""
    max_failure_fraction: float = 0.0
    """Fail the stage when more than this fraction of prompts ends without an answer."""
    retry_failed: bool = False
    """Ask again the prompts whose failure a rerun cannot change (refused with 400/413/422, empty greedy answer)."""
    server: TeacherServerConfig = field(
        default_factory=lambda: TeacherServerConfig(max_batch_tokens=1536, max_queue_fraction=0.5)
    )
    """The bundled server (endpoint 'local' only); its batches are bounded by their token budget so that a batch
    and the one waiting behind it end well within request_timeout_s (see README, Teacher generation)."""

    def __post_init__(self):
        super().__post_init__()
        _require(
            len(self.splits) > 0 and len(set(self.splits)) == len(self.splits),
            "splits",
            "must list train and/or eval once each",
        )
        _require(0 <= self.temperature <= 5, "temperature", f"must be in [0, 5], got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.max_tokens > 0, "max_tokens", f"must be > 0, got {self.max_tokens}")
        _require(
            0 <= self.max_failure_fraction <= 1,
            "max_failure_fraction",
            f"must be in [0, 1], got {self.max_failure_fraction}",
        )


# what a named teacher's source may be besides a pretrained model (hub id, local directory, .gguf file)
THE_TEACHER, ENDPOINT_SOURCE = "teacher", "endpoint"
TEACHER_NAME_CHARACTERS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


@dataclass(frozen=True)
class NamedTeacherConfig:
    """One teacher of several (``teachers.named``): its name, where it comes from, and for a built-in one the tasks
    it is trained on (a specialist)."""

    name: str = ""
    """What the route, the rows and the logs call it (letters, digits, _ and -): teacher_gen's rows carry it, OPD's
    step log has task/<name>/<column> for it, evaluate's tables a column per teacher."""
    source: str = BUILTIN
    """builtin (a built-in teacher the models stage trains, on ``tasks``), teacher (the models stage's own
    models.teacher, as built or pinned), a hub id, a local model directory or .gguf file (pinned by the models
    stage, mirrored under inputs.teachers), or endpoint (an OpenAI-compatible server that answers teacher_gen and
    scores OPD through prompt_logprobs: ``endpoint``)."""
    revision: str | None = None
    """A hub teacher's revision (branch, tag or commit; pinned to a commit); an endpoint teacher's model revision
    in teacher_gen's cache keys (set it when the served weights change under one name)."""
    tasks: tuple[str, ...] = ()
    """builtin only: the synthetic tasks it is trained on (empty: synthetic.tasks); a teacher trained on some of
    them is a specialist, poor at the rest."""
    steps: int | None = None
    """builtin only: its training steps (null: models.teacher_training.steps, whose other settings it keeps); a
    specialist of fewer tasks learns them in fewer steps."""
    endpoint: EndpointConfig = field(default_factory=EndpointConfig)
    """source endpoint only: its base URL (endpoint: http(s)://...), served model name, API key variable,
    concurrency, timeouts and retries, for teacher_gen's requests and OPD's scoring alike."""
    parameters: int | None = None
    """source endpoint only: its parameter count for the budget's FLOPs (2·P per scored token); null: the models
    stage's teacher's, as opd.teacher: endpoint assumes."""

    def __post_init__(self):
        _require(
            bool(self.name) and set(self.name) <= TEACHER_NAME_CHARACTERS,
            "name",
            f"must be letters, digits, _ and - (it names log columns), got {self.name!r}",
        )
        _require(bool(self.source.strip()), "source", "must be builtin, teacher, endpoint or a model")
        builtin = self.source == BUILTIN
        _require(
            builtin or not self.tasks,
            "tasks",
            f"only a built-in teacher is trained on tasks here; {self.source!r} is used as it is: set tasks: []",
        )
        _require(
            builtin or self.steps is None,
            "steps",
            f"only a built-in teacher is trained here; {self.source!r} is used as it is: set steps: null",
        )
        _require(self.steps is None or self.steps > 0, "steps", f"must be > 0, got {self.steps}")
        unknown = [t for t in self.tasks if t not in TASK_NAMES]
        _require(not unknown, "tasks", f"unknown task(s) {unknown}; allowed: {list(TASK_NAMES)}")
        _require(len(set(self.tasks)) == len(self.tasks), "tasks", f"lists a task twice: {list(self.tasks)}")
        endpoint = self.source == ENDPOINT_SOURCE
        if endpoint:
            _require(
                self.endpoint.endpoint != LOCAL_ENDPOINT,
                "endpoint.endpoint",
                "an endpoint teacher is a server of its own: set its http(s) base URL (endpoint: http://host:8000/v1)",
            )
        _require(
            endpoint or self.parameters is None,
            "parameters",
            "only an endpoint teacher's parameters are given here (a model's are counted): set null",
        )
        _require(self.parameters is None or self.parameters > 0, "parameters", f"must be > 0, got {self.parameters}")
        _require(
            not (is_gguf(self.source) and self.revision is not None),
            "revision",
            "a .gguf file is pinned by its sha256, it has no revisions: set revision to null",
        )

    @property
    def is_endpoint(self) -> bool:
        return self.source == ENDPOINT_SOURCE

    @property
    def is_model(self) -> bool:
        """Whether its weights are in the models stage's output or pinned by it (not an endpoint)."""
        return not self.is_endpoint


@dataclass(frozen=True)
class TeachersConfig:
    """Several teachers, one student: each prompt goes to the teacher that knows it (``ars_opd.models.teachers``).

    Empty ``named`` (the default) is the one teacher of ``models.teacher``, exactly as before: no stage reads the
    rest of the section then, and no output changes. With teachers named, every stage follows the route: the models
    stage pins each, teacher_gen asks each prompt's own teacher, OPD scores each rollout with its own teacher,
    evaluate measures each held-out row against its own. A prompt's teacher is ``route[row[route_by]]``, else
    ``default``; a prompt neither covers is refused before any work, naming it."""

    named: tuple[NamedTeacherConfig, ...] = ()
    """The teachers, each a mapping {name, source, revision, tasks, steps, endpoint, parameters}; empty:
    models.teacher alone."""
    route_by: str | None = "task"
    """The data column whose value picks a prompt's teacher (the synthetic tasks' and natural prompts' task);
    null: every prompt goes to ``default``."""
    route: dict[str, str] = field(default_factory=dict)
    """{value of the route_by column: teacher name}, e.g. {add: arith, reverse: words}."""
    default: str | None = None
    """The teacher of a prompt whose value the route does not name (null: such a prompt is refused)."""

    def __post_init__(self):
        names = [t.name for t in self.named]
        for i, name in enumerate(names):
            _require(name not in names[:i], f"named[{i}].name", f"{name!r} names two teachers")
        if not self.named:
            _require(
                not self.route and self.default is None,
                "named",
                "the route names teachers but none is named: list them under teachers.named, or empty "
                "teachers.route and teachers.default (models.teacher alone)",
            )
            return
        for value, teacher in self.route.items():
            _require(
                isinstance(teacher, str) and teacher in names,
                f"route.{value}",
                f"names no teacher {teacher!r} (teachers.named: {', '.join(names)})",
            )
        _require(
            self.default is None or self.default in names,
            "default",
            f"names no teacher {self.default!r} (teachers.named: {', '.join(names)})",
        )
        _require(
            self.default is not None or (self.route_by is not None and bool(self.route)),
            "route",
            "no prompt would reach a teacher: map route_by values to teachers, or set teachers.default",
        )
        _require(
            self.route_by is not None or not self.route,
            "route_by",
            "the route maps values of a column: name it (e.g. task), or leave teachers.route empty",
        )

    @property
    def active(self) -> bool:
        """Whether several-teacher routing is on (some teacher is named)."""
        return bool(self.named)

    def by_name(self, name: str) -> NamedTeacherConfig:
        return next(t for t in self.named if t.name == name)

    def teacher_of(self, value: Any) -> str | None:
        """The teacher of a prompt whose ``route_by`` column holds ``value`` (None: no teacher covers it)."""
        if self.route_by is not None and value is not None and str(value) in self.route:
            return self.route[str(value)]
        return self.default


FAULT_KINDS = ("label_noise", "shard_skew", "loss_scale", "drop_microbatch", "param_desync")


@dataclass(frozen=True)
class InjectConfig:
    """A deliberately injected data-parallel fault: a testing aid for the consistency detector, off by default."""

    kind: str | None = None
    """null (off), label_noise, shard_skew, loss_scale, drop_microbatch or param_desync."""
    stages: tuple[Literal["sft", "opd"], ...] = ("sft",)
    """The training stages that get the fault (label_noise: sft only)."""
    rank: int = 1
    """The faulty worker."""
    start_step: int = 100
    """First step with the fault (param_desync: the step whose start perturbs the weights)."""
    magnitude: float = 0.0
    """label_noise: fraction of the rank's target tokens replaced by random tokens, in (0, 1];
    shard_skew: fraction of the rank's items drawn from one task, in (0, 1] (1: it sees only that task);
    loss_scale: factor on the rank's loss in the backward (> 0, not 1); drop_microbatch: micro-batches the rank
    skips per step while still counting their tokens (a whole number >= 1); param_desync: epsilon, the
    perturbation's std relative to each parameter's RMS (> 0)."""
    task: str | None = None
    """shard_skew: the one task the faulty rank still sees (null: the first task in sorted order)."""

    def __post_init__(self):
        if self.kind is None:
            return
        _require(self.kind in FAULT_KINDS, "kind", f"must be null or one of {list(FAULT_KINDS)}, got {self.kind!r}")
        _require(self.rank >= 0, "rank", f"must be >= 0, got {self.rank}")
        _require(self.start_step >= 0, "start_step", f"must be >= 0, got {self.start_step}")
        m = self.magnitude
        ok = {
            "label_noise": 0 < m <= 1,
            "shard_skew": 0 < m <= 1,
            "loss_scale": m > 0 and m != 1,
            "drop_microbatch": m >= 1 and m == int(m),
            "param_desync": m > 0,
        }[self.kind]
        _require(ok, "magnitude", f"{m} is not a valid {self.kind} magnitude (see the key's description)")
        _require(len(self.stages) > 0, "stages", "must name sft and/or opd")
        _require(
            self.kind != "label_noise" or self.stages == ("sft",),
            "stages",
            "label_noise corrupts SFT labels: set stages: [sft]",
        )


@dataclass(frozen=True)
class ParallelConfig:
    """How the training stages run in parallel, and what they watch and seed: the workers and their layout
    (DDP or FSDP2, device, backend, buckets), the training seed and seed scenario, the consistency monitor,
    fault injection and resharded resumes. The params section is still ``ddp`` (its YAML key is kept stable;
    the class was ``DDPConfig`` until it held more than DDP's settings)."""

    workers: int = 2
    """Worker processes the stage starts on this machine (ignored under an outside torchrun/accelerate launch)."""
    strategy: Literal["ddp", "fsdp"] = "ddp"
    """ddp: every worker holds the whole student (torch DDP); fsdp: the student's weights, gradients and
    optimizer state are sharded over the workers (torch FSDP2, per decoder layer and the root)."""
    fsdp_reshard_after_forward: bool = True
    """fsdp: free each decoder layer's gathered weights after its forward and gather them again for its
    backward (least memory); false keeps them from the forward to the backward, one all-gather per layer per
    step instead of two, at the memory of the whole gathered student at the end of the forward (ZeRO-2's
    trade). The same gradients either way (tested); sharded at rest either way."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when visible (one GPU per worker), else CPU."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """auto: nccl on CUDA, gloo on CPU."""
    threads_per_worker: int = 1
    """torch CPU threads per worker."""
    bucket_cap_mb: float = 25.0
    """DDP gradient bucket size."""
    gradient_as_bucket_view: bool = True
    """Let .grad alias DDP's buckets (saves a copy)."""
    seed: int = 0
    """Training seed of the sft and opd stages (data order, sampling); apart from base.seed, so a seed sweep
    rebuilds neither the models nor the data."""
    scenario: Literal["S1-1", "S1-2", "S1-3"] = "S1-1"
    """Seed scenario: S1-1 one seed everywhere; S1-2 rank 0's seed differs; S1-3 every rank's seed differs."""
    consistency: bool = True
    """Record per-worker loss and gradient statistics before the all-reduce (a DDP comm hook)."""
    gram_every: int = 50
    """With more than 2 workers: exact pairwise cosines (Gram matrix of local gradients) every this many steps."""
    noise_scale_ema: float = 0.95
    """EMA factor for the gradient noise scale's numerator and denominator (each step's estimate is noisy)."""
    drift_check_every: int = 10
    """Every this many steps, compare a bit-exact fingerprint of every rank's parameters and optimizer state
    (DDP syncs gradients, never weights; 0: never)."""
    inject: InjectConfig = field(default_factory=InjectConfig)
    """Fault injection for testing the detector (off unless inject.kind is set)."""
    timeout_s: float = 600.0
    """Process-group timeout."""
    reshard_resume: bool = False
    """Resume a checkpoint of this run made by another worker count or strategy, resharded (fsdp checkpoints
    load into any layout), instead of starting afresh; the stage says so and its manifest records it."""

    def __post_init__(self):
        _require(1 <= self.workers <= 1024, "workers", f"must be in 1..1024, got {self.workers}")
        _require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        _require(0 <= self.noise_scale_ema < 1, "noise_scale_ema", f"must be in [0, 1), got {self.noise_scale_ema}")
        _require(self.drift_check_every >= 0, "drift_check_every", f"must be >= 0, got {self.drift_check_every}")
        _require(
            self.inject.kind is None or self.inject.rank < self.workers,
            "inject.rank",
            f"must name one of the {self.workers} workers, got {self.inject.rank}",
        )
        _require(self.threads_per_worker >= 0, "threads_per_worker", f"must be >= 0, got {self.threads_per_worker}")
        _require(self.bucket_cap_mb > 0, "bucket_cap_mb", f"must be > 0, got {self.bucket_cap_mb}")
        _require(self.timeout_s > 0, "timeout_s", f"must be > 0, got {self.timeout_s}")
        _require(self.gram_every >= 0, "gram_every", f"must be >= 0, got {self.gram_every}")
        _require(
            not (self.strategy == "fsdp" and self.inject.kind == "param_desync"),
            "inject.kind",
            "param_desync perturbs one replica's weights, and under ddp.strategy: fsdp there are no replicas "
            "(each worker holds a shard and computes with the gathered whole); use ddp.strategy: ddp",
        )
        _require(not (self.device == "cpu" and self.backend == "nccl"), "backend", "nccl needs device cuda")


@dataclass(frozen=True)
class TrainLoopConfig(OptimConfig):
    """The data-parallel optimisation loop shared by SFT and OPD."""

    steps: int = 400
    """Optimizer steps."""
    global_batch_size: int = 32
    """Sequences per optimizer step, over all workers and accumulation micro-batches."""
    micro_batch_size: int = 16
    """Sequences per forward/backward on one worker (accumulation = global / workers / micro)."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """On a non-finite loss or gradient: stop with a message, or skip the step (counted)."""
    max_skipped_steps: int = 20
    """Stop anyway once more steps than this were skipped."""
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    """auto: bf16 autocast on CUDA, fp32 on CPU."""
    checkpoint_every: int = 100
    """Steps between checkpoints (0: only at the end)."""
    keep_checkpoints: int = 2
    """Checkpoints kept on disk."""
    snapshot_every: int = 0
    """Keep the weights every this many steps with the model (snapshots/step_N: learning-curve points that the
    evaluate stage scores; 0: none). Each is a full copy of the student's weights."""

    def __post_init__(self):
        super().__post_init__()
        _require(self.steps > 0, "steps", f"must be > 0, got {self.steps}")
        _require(
            self.warmup_steps <= self.steps,
            "warmup_steps",
            f"must be <= steps ({self.steps}), got {self.warmup_steps}: the learning rate would never reach "
            "its peak; lower warmup_steps or raise steps",
        )
        _require(self.global_batch_size > 0, "global_batch_size", f"must be > 0, got {self.global_batch_size}")
        _require(
            0 < self.micro_batch_size <= self.global_batch_size,
            "micro_batch_size",
            f"must be in 1..global_batch_size ({self.global_batch_size}), got {self.micro_batch_size}",
        )
        _require(self.max_skipped_steps >= 0, "max_skipped_steps", f"must be >= 0, got {self.max_skipped_steps}")
        _require(self.checkpoint_every >= 0, "checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
        _require(self.keep_checkpoints >= 1, "keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        _require(self.snapshot_every >= 0, "snapshot_every", f"must be >= 0, got {self.snapshot_every}")


@dataclass(frozen=True)
class SFTConfig(TrainLoopConfig):
    """Supervised fine-tuning of the student on the teacher's completions (loss on response tokens)."""

    # the shared loop's keys whose params.yaml value is not the loop's generic default, at sft's value
    steps: int = 1000
    """Optimizer steps."""
    warmup_steps: int = 30
    """Linear warmup steps before the cosine decay."""
    max_grad_norm: float | None = 3.0
    """Clip the global gradient norm to this, a guard (~p95 of pre-clip norms on the default, median ~1.7), not
    the optimiser; null = noclip (the pre-clip norm is logged either way)."""
    snapshot_every: int = 250
    """Keep the weights every this many steps with the model (learning-curve points; 0: none)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are dropped (counted), never cut: a cut prompt is another task."""
    max_completion_tokens: int = 64
    """Completions (EOS included) longer than this are truncated (counted)."""
    max_seq_len: int = 512
    """Prompt + completion budget; a row left with no room for any completion token is dropped (counted)."""
    packing: bool = False
    """Padding-free packing: concatenate sequences into rows of pack_length, positions reset, no cross-attention."""
    pack_length: int = 512
    """Tokens per packed row."""
    packed_attention: Literal["auto", "flash", "flex", "sdpa"] = "auto"
    """Packed rows' attention (no L x L mask): flash varlen, flex (CUDA), sdpa per sequence; auto: best available."""
    chunk_size: int = 256
    """Positions per chunk of the cross-entropy from hidden states (bounds its (chunk x vocabulary) fp32 memory)."""
    truncated_completions: Literal["keep", "drop"] = "keep"
    """A teacher completion cut at teacher_gen.max_tokens (finish_reason length) never gets an EOS: keep trains
    on it without an end, drop leaves the row out; counted either way. Also the control arm's (sft_continued)."""

    def __post_init__(self):
        super().__post_init__()
        _require(self.max_prompt_tokens > 0, "max_prompt_tokens", f"must be > 0, got {self.max_prompt_tokens}")
        _require(
            self.max_completion_tokens > 0, "max_completion_tokens", f"must be > 0, got {self.max_completion_tokens}"
        )
        _require(self.max_seq_len > 1, "max_seq_len", f"must be > 1, got {self.max_seq_len}")
        _require(
            self.pack_length >= self.max_seq_len or not self.packing,
            "pack_length",
            f"must be >= max_seq_len ({self.max_seq_len}) so every sequence fits a packed row",
        )
        _require(self.chunk_size > 0, "chunk_size", f"must be > 0, got {self.chunk_size}")


@dataclass(frozen=True)
class OPDConfig(TrainLoopConfig):
    """On-policy distillation: student rollouts scored by the frozen teacher, token-level divergence."""

    # the shared loop's keys whose params.yaml value is not the loop's generic default, at opd's value
    steps: int = 300
    """Optimizer steps."""
    lr: float = 1e-3
    """Peak AdamW learning rate."""
    warmup_steps: int = 10
    """Linear warmup steps before the cosine decay."""
    max_grad_norm: float | None = 12.0
    """Clip the global gradient norm to this, a guard (~p95 of pre-clip norms on the default, median ~6.4);
    null = noclip (the pre-clip norm is logged either way)."""
    snapshot_every: int = 100
    """Keep the weights every this many steps with the model (learning-curve points; also the loop of
    sft_continued, the control arm; 0: none)."""
    loss: str = "full_vocab"
    """An objective of ars_opd.lm.opd_objectives: full_vocab (exact divergence over the vocabulary), sampled_token
    (an unbiased single-sample policy-gradient estimator of reverse KL's gradient from the sampled tokens' teacher
    log-probabilities, not exact) or topk (a top-k approximation)."""
    cross_tokenizer: bool = False
    """Allow a teacher whose tokenizer is not the student's (the models stage refuses such a pair without it). The
    student's rollouts are rendered to text, tokenised by the teacher under its own chat template and scored there;
    the losses compare the two tokenisations span by span (``ars_opd.lm.token_alignment``): sampled_token (the
    sequence-exact sampled estimate of reverse KL, each span's log-ratio its tokens' credit) or cross_vocab (a
    divergence over the tokens both vocabularies share plus ULD's sorted-probability distance for the rest, at
    the positions where both sides start a token on the same character)."""
    span_baseline: Literal["none", "leave_one_out"] = "none"
    """The baseline of the cross-tokenizer sampled_token credit (cross_tokenizer, loss: sampled_token). none: each
    span's log-ratio d_s = log q(span) - log p(span) is its tokens' credit as it is. leave_one_out: d_s less the mean
    credit of the other rollouts of the same micro-batch (per aligned student token), a control variate: it is
    computed from rollouts sampled independently of this one, so the expected gradient is the same as none's, while a
    credit that is positive almost everywhere (a span's log-ratio was 6-8 nats a token in the last cross-tokenizer
    study) no longer pushes down most of what the student sampled. Needs micro_batch_size >= 2."""
    beta: float = 1.0
    """Divergence: 0 forward KL, 1 reverse KL, in between generalised JSD (objectives that use beta)."""
    temperature: float = 1.0
    """Temperature of both distributions in the divergence."""
    teacher_temperature: float | None = None
    """The teacher's own temperature in the divergence (loss: full_vocab, a local teacher): p = softmax(z_T /
    teacher_temperature); below 1 the student is distilled towards the teacher's sharpened distribution, whose most
    likely token is the teacher's greedy choice (what the SFT stage's greedy completions and a greedy evaluation
    hold). null: the same as temperature."""
    loss_normalisation: Literal["token", "sequence"] = "token"
    """What the step's loss averages over: token (every loss token of the global batch weighs the same, so a long
    rollout weighs more than a short one) or sequence (each completion's mean over its tokens, then the mean over
    the global batch's completions: every completion weighs the same)."""
    chunk_size: int = 256
    """Positions per chunk of the losses from hidden states, student and teacher (bounds their fp32 memory)."""
    sample_temperature: float = 1.0
    """Rollout sampling temperature (0 = greedy)."""
    top_p: float = 1.0
    """Rollout nucleus sampling mass."""
    max_new_tokens: int = 12
    """Longest rollout."""
    on_policy_fraction: float = 1.0
    """GKD λ: probability that a step uses student rollouts (else the teacher's cached completions)."""
    max_prompt_tokens: int = 256
    """Prompts longer than this are dropped (counted)."""
    truncated_completions: Literal["keep", "drop"] = "keep"
    """As sft.truncated_completions, for the teacher-text steps (on_policy_fraction < 1): a completion cut at
    teacher_gen.max_tokens gets no EOS; keep trains on it without an end, drop leaves the row out (its prompt
    too); counted. With on_policy_fraction 1 no teacher text is trained on and nothing is dropped."""
    rollout_cache: Literal["dynamic", "static"] = "dynamic"
    """Rollout KV cache: dynamic (transformers' generate) or static (preallocated, our loop, compiled on CUDA)."""
    rollout_dtype: Literal["train", "bf16"] = "train"
    """Trainer rollouts in the training precision (train), or from a bf16 copy of the student refreshed every step
    (bf16: 1.6-1.9x faster sampling on a CPU with AMX, best with rollout_cache: static; the samples are the
    bf16-rounded policy's, so not with sampled_token; not with FSDP)."""
    teacher_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Weights of the frozen teacher; auto: bf16 on CUDA, fp32 on CPU."""
    teacher: Literal["local", "endpoint"] = "local"
    """Who scores rollouts: local (the teacher's weights in every worker) or endpoint (a served teacher's
    prompt_logprobs, e.g. vLLM; the trainer never loads teacher weights)."""
    topk: int = 20
    """Teacher tokens per position for the topk loss (the prompt_logprobs k; vLLM needs --max-logprobs >= it)."""
    teacher_endpoint: EndpointConfig = field(default_factory=lambda: EndpointConfig(concurrency=8))
    """The scoring endpoint (opd.teacher: endpoint): 'local' starts the bundled server for the models-stage teacher."""
    teacher_server: TeacherServerConfig = field(default_factory=TeacherServerConfig)
    """The bundled server (opd.teacher: endpoint with teacher_endpoint.endpoint 'local' only)."""
    truncated_rollouts: Literal["keep", "mask", "penalize"] = "keep"
    """What a rollout cut at max_new_tokens (no EOS) trains on: keep (as an ended one), mask (its tokens carry no
    loss and no gradient; they stay in the step's count, so a step whose rollouts were all cut has a zero
    gradient) or penalize (kept, plus DAPO's overlong penalty turned into a policy-gradient term: each of its
    sampled tokens gets the advantage -overlong_penalty, which moves probability off the continuation that never
    ended and onto the rest, EOS included). On the student's rollouts only; teacher text follows
    truncated_completions."""
    overlong_penalty: float = 0.1
    """The penalty of truncated_rollouts: penalize, per token of a cut rollout (a loss term overlong_penalty·log
    q(y), its gradient overlong_penalty·(onehot(y) - q))."""
    anchor: Literal["none", "sft", "forward_kl"] = "none"
    """An anchor on the teacher's text in every on-policy step: the teacher's cached completions of the step's own
    prompts (those the SFT stage trained on; no new teacher cost) trained beside the rollouts, with sft their
    cross-entropy, with forward_kl the full-vocabulary KL(teacher || student) on them (a local teacher). GKD's
    on_policy_fraction mixes whole steps instead."""
    anchor_weight: float = 0.5
    """The anchor's weight: its token losses times this are added to the rollouts' and divided by the same
    normaliser (the step's rollout tokens, or completions with loss_normalisation: sequence, each anchor row then
    weighing anchor_weight / its length)."""
    constant_advantage: float = -1.0
    """The advantage of every sampled token under loss: constant_advantage (the control of a fixed negative
    signal: the sampled-token policy gradient with the teacher's log-ratio replaced by this constant, no teacher
    information in the update; the teacher still scores, for the log)."""
    rollouts: Literal["trainer", "engine"] = "trainer"
    """Who samples the student's rollouts: trainer (each training worker, transformers generate or the static
    loop) or engine (an inference server serving the student, synced after updates: opd.engine)."""
    engine: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    """The rollout engine (opd.rollouts: engine only)."""

    def __post_init__(self):
        super().__post_init__()
        _require(self.topk >= 1, "topk", f"must be >= 1, got {self.topk}")
        # which losses exist and what each demands (beta, pure on-policy rollouts) is checked against RULES
        # by check_objective, which load_params runs (check_params): it spans several keys of the section
        _require(bool(self.loss.strip()), "loss", "must name an objective, e.g. full_vocab or sampled_token")
        _require(0 <= self.beta <= 1, "beta", f"must be in [0, 1] (0 forward KL, 1 reverse KL), got {self.beta}")
        _require(self.temperature > 0, "temperature", f"must be > 0, got {self.temperature}")
        _require(
            self.teacher_temperature is None or self.teacher_temperature > 0,
            "teacher_temperature",
            f"must be > 0 or null, got {self.teacher_temperature}",
        )
        _require(self.chunk_size > 0, "chunk_size", f"must be > 0, got {self.chunk_size}")
        _require(
            0 <= self.sample_temperature <= 5, "sample_temperature", f"must be in [0, 5], got {self.sample_temperature}"
        )
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(self.max_new_tokens > 0, "max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        _require(
            0 <= self.on_policy_fraction <= 1, "on_policy_fraction", f"must be in [0, 1], got {self.on_policy_fraction}"
        )
        _require(self.max_prompt_tokens > 0, "max_prompt_tokens", f"must be > 0, got {self.max_prompt_tokens}")
        _require(self.overlong_penalty >= 0, "overlong_penalty", f"must be >= 0, got {self.overlong_penalty}")
        _require(self.anchor_weight >= 0, "anchor_weight", f"must be >= 0, got {self.anchor_weight}")


@dataclass(frozen=True)
class ControlConfig:
    """OPD's control arm (the sft_continued stage): what its more SFT trains on.

    OPD and the control start from the same SFT student and run the same loop; the control's data is the
    question. ``repeat`` gives it the SFT stage's own teacher completions again (more epochs over the same
    prompts, no new teacher cost); ``fresh`` gives it the teacher's completions of prompts neither SFT nor OPD
    saw, as a user with more teacher budget would: the last ``fresh_rows`` rows of the train split, held back
    from the sft and opd stages (raise ``data.subset_size`` by as many)."""

    data: Literal["repeat", "fresh"] = "repeat"
    """repeat: the SFT stage's rows again; fresh: the held-back rows (each once when there are as many as the
    control's steps × global batch, in epochs over them when fewer)."""
    fresh_rows: int = 0
    """Rows at the end of the train split held back from sft and opd for the control (0: none)."""

    def __post_init__(self):
        _require(self.fresh_rows >= 0, "fresh_rows", f"must be >= 0, got {self.fresh_rows}")
        _require(
            self.data == "repeat" or self.fresh_rows > 0,
            "fresh_rows",
            "control.data: fresh needs rows held back for it: set fresh_rows (and raise data.subset_size by as many)",
        )


@dataclass(frozen=True)
class EvaluateConfig:
    """Held-out evaluation of every student (base, SFT, OPD, continued SFT) and the teacher."""

    max_examples: int = 0
    """Evaluate on the first N held-out prompts (0: all)."""
    curve_examples: int = 50
    """Score learning-curve snapshots on the first N of those prompts (0: all of them)."""
    max_new_tokens: int = 16
    """Longest greedy answer and student sample."""
    batch_size: int = 64
    """Prompts per generate call."""
    seed: int = 0
    """Seed of the student samples behind reverse KL."""
    threads: int = 2
    """torch CPU threads."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """auto: CUDA when visible, else CPU."""
    teacher_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Weights of the teacher; auto: bf16 on CUDA, fp32 on CPU (the students stay fp32)."""
    chunk_size: int = 256
    """Positions per chunk of the NLL and reverse KL from hidden states."""
    sampled_draws: int = 1
    """Samples per held-out prompt behind sampled exact match (temperature 1): the first is the reverse-KL sample
    (no extra cost), each further one a generate pass over the prompts."""

    def __post_init__(self):
        _require(self.chunk_size > 0, "chunk_size", f"must be > 0, got {self.chunk_size}")
        _require(self.sampled_draws >= 1, "sampled_draws", f"must be >= 1, got {self.sampled_draws}")
        _require(self.max_examples >= 0, "max_examples", f"must be >= 0, got {self.max_examples}")
        _require(self.curve_examples >= 0, "curve_examples", f"must be >= 0, got {self.curve_examples}")
        _require(self.max_new_tokens > 0, "max_new_tokens", f"must be > 0, got {self.max_new_tokens}")
        _require(self.batch_size > 0, "batch_size", f"must be > 0, got {self.batch_size}")
        _require(self.threads >= 0, "threads", f"must be >= 0, got {self.threads}")


@dataclass(frozen=True)
class ReportConfig:
    """The report's consistency detector (``ars_opd.evaluation.detector``): per-rank CUSUM tests."""

    warmup: int = 100
    """Steps not judged at the start of a stage (the null is learned from the run's own earlier steps)."""
    window: int = 100
    """Trailing steps whose pooled per-rank residuals give each statistic's median and MAD."""
    lag: int = 5
    """The window ends this many steps back, so a change does not dilute its own yardstick at once."""
    k: float = 0.5
    """CUSUM reference value in robust standard deviations (half the smallest shift it is tuned for)."""
    clip_z: float = 4.0
    """Standardised values are clipped at +-clip_z, so one heavy-tailed step cannot raise an alarm alone."""
    false_alarms_per_1000: float = 0.01
    """Design false-alarm rate per 1,000 steps (every statistic, rank and side) for independent Gaussian
    scores, from which the threshold is computed, with three or more workers; real runs alarm more often
    than independent scores would, so it is calibrated on healthy runs of the default pipeline at K = 4
    (``studies/detection.py``) to keep the measured rate at or below 1 per 1,000."""
    two_worker_false_alarms_per_1000: float = 0.1
    """The same with two workers, where one test per statistic sees both (calibrated at K = 2)."""
    rollout_baseline_steps: int = 1
    """Rollout health (``ars_opd.training.opd.rollout_health``): the first on-policy steps whose rollouts are the
    start each later window is tested against (step 0's are the start model's own)."""
    rollout_window: int = 4
    """Rollout health: the last on-policy steps tested against the baseline at each step. 4 rather than 6 or 8
    (``studies/rollout_health.py`` over every committed study run that samples; the counts are in
    reports/rollout_health.jsonl): no false alarm on the healthy runs at any of them at α 1e-4, the same collapsed
    runs caught, and the alarm a median 3 steps after the collapse rather than 5 or 7. A baseline of 2 or 3 steps
    did worse there: more false alarms, fewer collapses caught."""
    rollout_alpha: float = 1e-4
    """Rollout health: a test's p-value below this raises the alarm (five one-sided tests a step: EOS rate down
    and up, cut share up, mean length up and down); the false-alarm rate measured on healthy runs is in the
    report."""

    def __post_init__(self):
        _require(self.warmup >= 0, "warmup", f"must be >= 0, got {self.warmup}")
        _require(
            self.rollout_baseline_steps >= 1,
            "rollout_baseline_steps",
            f"must be >= 1, got {self.rollout_baseline_steps}",
        )
        _require(self.rollout_window >= 1, "rollout_window", f"must be >= 1, got {self.rollout_window}")
        _require(0 < self.rollout_alpha < 1, "rollout_alpha", f"must be in (0, 1), got {self.rollout_alpha}")
        _require(self.window >= 4, "window", f"must be >= 4, got {self.window}")
        _require(self.lag >= 0, "lag", f"must be >= 0, got {self.lag}")
        _require(self.k > 0, "k", f"must be > 0, got {self.k}")
        _require(self.clip_z > self.k, "clip_z", f"must be > k ({self.k}), got {self.clip_z}")
        _require(
            self.false_alarms_per_1000 > 0, "false_alarms_per_1000", f"must be > 0, got {self.false_alarms_per_1000}"
        )
        _require(
            self.two_worker_false_alarms_per_1000 > 0,
            "two_worker_false_alarms_per_1000",
            f"must be > 0, got {self.two_worker_false_alarms_per_1000}",
        )


SECTIONS: dict[str, type] = {
    "base": BaseConfig,
    "paths": PathsConfig,
    "synthetic": SyntheticConfig,
    "models": ModelsConfig,
    "data": DataConfig,
    "inputs": InputsConfig,
    "teacher_gen": TeacherGenConfig,
    "teachers": TeachersConfig,
    "ddp": ParallelConfig,
    "sft": SFTConfig,
    "opd": OPDConfig,
    "control": ControlConfig,
    "evaluate": EvaluateConfig,
    "report": ReportConfig,
}


# --------------------------------------------------------------------------------------------------
# parsing


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        sections = [a for a in args if dataclasses.is_dataclass(a)]
        if isinstance(value, Mapping) and len(sections) == 1:  # a mapping is that section: its errors name its keys
            return parse_section(sections[0], value, key)
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key)
            except ConfigError as e:
                errors.append(e.message)
        raise ConfigError(key, " or ".join(errors))
    if origin is Literal:
        allowed = typing.get_args(tp)
        _require(value in allowed, key, f"must be one of {list(allowed)}, got {value!r}")
        return value
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        _require(isinstance(value, Mapping), key, f"must be a mapping, got {value!r}")
        return {_coerce(key_tp, str(k), key): _coerce(value_tp, v, f"{key}.{k}") for k, v in value.items()}
    if origin is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        _require(isinstance(value, (list, tuple)), key, f"must be a list, got {value!r}")
        return tuple(_coerce(item_tp, v, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return parse_section(tp, value, key)
    if tp is bool:
        _require(isinstance(value, bool), key, f"must be true or false, got {value!r}")
        return value
    if tp is int:
        _require(isinstance(value, int) and not isinstance(value, bool), key, f"must be an integer, got {value!r}")
        return value
    if tp is float:
        _require(
            isinstance(value, (int, float)) and not isinstance(value, bool), key, f"must be a number, got {value!r}"
        )
        return float(value)
    if tp is str:
        _require(isinstance(value, str), key, f"must be a string, got {value!r}")
        return value
    raise TypeError(f"{key}: unsupported config type {_type_name(tp)}")


def parse_section(cls: type, raw: Any, where: str) -> Any:
    """Build dataclass ``cls`` from mapping ``raw``; errors name keys as ``where.key``."""
    if raw is None:
        raw = {}
    _require(isinstance(raw, Mapping), where, f"must be a mapping of keys to values, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", f"unknown key (allowed in {where}: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(hints[name], raw[name], f"{where}.{name}") for name in fields if name in raw}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        # __post_init__ names keys relative to its own section
        raise ConfigError(f"{where}.{e.key}" if e.key else where, e.message) from None


@dataclass(frozen=True)
class Params:
    """The parsed sections of params.yaml (None for sections not asked for)."""

    base: BaseConfig | None = None
    paths: PathsConfig | None = None
    synthetic: SyntheticConfig | None = None
    models: ModelsConfig | None = None
    data: DataConfig | None = None
    inputs: InputsConfig | None = None
    teacher_gen: TeacherGenConfig | None = None
    teachers: TeachersConfig | None = None
    ddp: ParallelConfig | None = None
    sft: SFTConfig | None = None
    opd: OPDConfig | None = None
    control: ControlConfig | None = None
    evaluate: EvaluateConfig | None = None
    report: ReportConfig | None = None


class ParamsLoader(yaml.SafeLoader):
    """PyYAML's safe loader (YAML 1.1), reading a float written without a dot (``5e-05``, ``1e3``) as a float, as
    YAML 1.2 does. DVC writes the params of an experiment (``dvc exp run -S opd.lr=5e-5``, a profile) with a YAML 1.2
    writer, which puts every float below 1e-4 that way, and YAML 1.1 would read it back as the string '5e-05'."""


ParamsLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def read_params_file(path: str | Path = PARAMS_FILE) -> dict:
    path = Path(path)
    if not path.exists():
        raise ConfigError("", f"{path} not found (run from the repository root)")
    raw = yaml.load(path.read_text(), Loader=ParamsLoader) or {}
    _require(isinstance(raw, Mapping), "", f"{path}: top level must be a mapping of sections")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        raise ConfigError(unknown[0], f"unknown section in {path} (allowed: {', '.join(SECTIONS)})")
    return dict(raw)


def load_params(
    path: str | Path = PARAMS_FILE,
    sections: tuple[str, ...] | None = None,
    base: str | Path | None = None,
    raw: Mapping | None = None,
) -> Params:
    """Parse the named sections (all if None) of a params file and run every check a stage runs on them
    (``check_params``): a ``ConfigError`` from here is all a stage or ``ars-opd params`` can refuse. ``base``:
    where relative paths start (default: the params file's directory). ``raw``: the file as ``read_params_file``
    returned it, for a caller that parses several sections apart from one reading (then ``path`` only places
    ``base``)."""
    raw = read_params_file(path) if raw is None else raw
    names = tuple(SECTIONS) if sections is None else sections
    for name in names:
        if name not in SECTIONS:
            raise KeyError(f"no params section {name!r}; known: {list(SECTIONS)}")
    params = Params(**{name: parse_section(SECTIONS[name], raw.get(name), name) for name in names})
    check_params(params, Path(base if base is not None else Path(path).resolve().parent))
    return params


# What each OPD loss needs from the teacher and demands of the rollouts: torch-free, so that ``load_params``
# runs ``check_objective`` for every stage ("valid params" means one thing). The losses themselves, with
# these rules attached, are the registry of ``ars_opd.lm.opd_objectives``; a new loss is one entry here and one
# there.
@dataclass(frozen=True)
class ObjectiveRules:
    name: str
    teacher_signal: Literal["logits", "token_logprobs", "topk"]
    """What the teacher must provide."""
    uses_beta: bool
    """Whether ``opd.beta`` means anything (else it must stay 1.0)."""
    exact_on_policy: bool
    """Needs exactly on-policy samples: its gradient is an unbiased estimate only for pure student samples at the
    loss temperature (λ = 1, top_p = 1)."""


RULES: dict[str, ObjectiveRules] = {
    r.name: r
    for r in (
        ObjectiveRules("full_vocab", "logits", uses_beta=True, exact_on_policy=False),
        ObjectiveRules("sampled_token", "token_logprobs", uses_beta=False, exact_on_policy=True),
        ObjectiveRules("topk", "topk", uses_beta=True, exact_on_policy=False),
        ObjectiveRules("cross_vocab", "logits", uses_beta=True, exact_on_policy=False),
        ObjectiveRules("constant_advantage", "token_logprobs", uses_beta=False, exact_on_policy=True),
    )
}

CROSS_TOKENIZER_LOSSES = ("sampled_token", "cross_vocab")  # what opd.cross_tokenizer trains with


def check_objective(cfg: OPDConfig) -> ObjectiveRules:
    """The rules of the loss ``cfg.loss`` names, if ``cfg`` lets it train correctly; else ``ConfigError``
    naming the key."""
    if cfg.loss not in RULES:
        raise ConfigError("opd.loss", f"must be one of {list(RULES)}, got {cfg.loss!r}")
    rules = RULES[cfg.loss]
    if cfg.rollout_dtype == "bf16" and cfg.rollouts == "engine":
        raise ConfigError(
            "opd.rollout_dtype",
            "engine rollouts are in the engine's dtype (opd.engine.dtype); set rollout_dtype: train",
        )
    if cfg.rollout_dtype == "bf16" and rules.exact_on_policy:
        raise ConfigError(
            "opd.rollout_dtype",
            f"the {cfg.loss} loss needs samples of exactly the trained student, and a bf16 copy's are the rounded "
            "policy's; use rollout_dtype: train with it",
        )
    if cfg.cross_tokenizer and cfg.loss not in CROSS_TOKENIZER_LOSSES:
        raise ConfigError(
            "opd.loss",
            f"with opd.cross_tokenizer the teacher scores its own tokenisation of the student's text, so a loss over "
            f"one shared vocabulary ({cfg.loss}) is undefined; use one of {list(CROSS_TOKENIZER_LOSSES)}",
        )
    if not cfg.cross_tokenizer and cfg.loss == "cross_vocab":
        raise ConfigError("opd.loss", "cross_vocab is the cross-tokenizer loss: set opd.cross_tokenizer: true")
    if cfg.cross_tokenizer and cfg.teacher == "endpoint" and cfg.loss != "sampled_token":
        raise ConfigError(
            "opd.loss",
            "a scoring endpoint returns the log-probabilities of the teacher's own tokens, not its distributions at "
            "the aligned positions; with opd.teacher: endpoint and opd.cross_tokenizer use sampled_token",
        )
    if cfg.teacher == "endpoint":  # a served teacher returns log-probabilities at τ = 1, top-k at most
        if rules.teacher_signal == "logits":
            raise ConfigError(
                "opd.loss",
                f"the {cfg.loss} loss needs the teacher's full distribution, which a "
                "scoring endpoint does not return; with opd.teacher: endpoint use "
                "sampled_token (an unbiased single-sample estimator of reverse KL's gradient) or topk "
                "(top-k approximation)",
            )
        if rules.teacher_signal == "token_logprobs" and cfg.temperature != 1.0:
            raise ConfigError(
                "opd.temperature",
                f"an endpoint's prompt_logprobs are log-softmax at temperature 1 "
                f"and log p_T(y) at τ = {cfg.temperature} needs the whole "
                f"distribution; set 1.0 with opd.teacher: endpoint (or use topk, "
                "which renormalises over the top-k at τ)",
            )
    if cfg.teacher_temperature is not None and (cfg.loss != "full_vocab" or cfg.teacher != "local"):
        raise ConfigError(
            "opd.teacher_temperature",
            "a teacher temperature of its own is offered for loss: full_vocab with a local teacher (an endpoint's "
            "log-probabilities are at temperature 1); set null",
        )
    if cfg.anchor == "forward_kl" and cfg.teacher != "local":
        raise ConfigError(
            "opd.anchor",
            "the forward_kl anchor needs the teacher's full distribution on its own text (a local teacher); with "
            "opd.teacher: endpoint use anchor: sft",
        )
    if cfg.span_baseline != "none":
        if not cfg.cross_tokenizer or cfg.loss != "sampled_token":
            raise ConfigError(
                "opd.span_baseline",
                "a baseline of the span credit is offered for the cross-tokenizer sampled_token loss "
                "(opd.cross_tokenizer: true, opd.loss: sampled_token); set none",
            )
        if cfg.micro_batch_size < 2:
            raise ConfigError(
                "opd.span_baseline",
                "the leave-one-out baseline is the mean credit of the micro-batch's other rollouts, and a "
                f"micro-batch of {cfg.micro_batch_size} has none: raise opd.micro_batch_size to 2 or more, or set none",
            )
    if cfg.anchor != "none" and cfg.cross_tokenizer:
        raise ConfigError("opd.anchor", "an anchor on the teacher's text is not offered across tokenizers; set none")
    if cfg.loss == "constant_advantage" and cfg.cross_tokenizer:
        raise ConfigError("opd.loss", "constant_advantage is a same-tokenizer control; use sampled_token across")
    if not rules.uses_beta and cfg.beta != 1.0:
        raise ConfigError("opd.beta", f"the {cfg.loss} loss estimates reverse KL only; set beta: 1.0")
    lagged = cfg.rollouts == "engine" and cfg.engine.max_lag > 0
    if lagged and rules.exact_on_policy and cfg.temperature != 1.0:
        raise ConfigError(
            "opd.temperature",
            f"the {cfg.loss} loss with opd.engine.max_lag {cfg.engine.max_lag} weights each token by q_now / "
            "q_sampler, and the engine reports log-probabilities at temperature 1; set 1.0, or max_lag: 0",
        )
    if rules.exact_on_policy:  # its gradient estimate is unbiased only for tokens drawn from q at the temperature
        if cfg.on_policy_fraction != 1.0:
            raise ConfigError(
                "opd.on_policy_fraction",
                f"the {cfg.loss} loss needs tokens sampled from the student (teacher completions "
                f"would bias its gradient with no importance weight); set 1.0, got "
                f"{cfg.on_policy_fraction}",
            )
        if cfg.sample_temperature != cfg.temperature or cfg.top_p != 1.0:
            raise ConfigError(
                "opd.sample_temperature",
                f"the {cfg.loss} loss needs rollouts from the distribution it differentiates: "
                f"sample_temperature == temperature ({cfg.temperature}) and top_p == 1.0, got "
                f"{cfg.sample_temperature} and {cfg.top_p}",
            )
    return rules


def check_params(params: Params, base: str | Path = ".") -> None:
    """The checks beyond each section's own that the stages run on their params, for the sections
    ``params`` holds; ``ConfigError`` naming the key. ``base``: where relative paths start (the repo root).

    - ``inputs``: each local source of ``data``/``models`` is mirrored by its ``inputs`` key (``check_inputs``);
    - ``opd``: the objective ``opd.loss`` trains correctly with these settings
      (``check_objective``; ``run_opd`` calls it again for configs built in code);
    - ``ddp`` with ``sft``/``opd``: the global batch splits over ``ddp.workers`` and then into micro-batches
      (``batch_split_problem``, which every worker runs again with the real world
      size). Skipped in a worker of an outside launcher (torchrun): ``ddp.workers`` is ignored there.

    Left to the stages, which refuse them when they meet them: what depends on the machine or the data, not
    on the params (a packed attention this machine cannot run, ``ddp.device: cuda`` without a GPU, too few
    rows for one step, an endpoint that is unreachable or serves another model).
    """
    if params.inputs is not None:
        check_inputs(params.inputs, params.data, params.models, base)
    if params.opd is not None:
        check_objective(params.opd)
    if params.teachers is not None and params.teachers.active:
        check_teachers(params, base)
    if params.models is not None and params.opd is not None and params.models.mixed_builtin:
        if not params.opd.cross_tokenizer:
            raise ConfigError(
                "opd.cross_tokenizer",
                f"models.teacher {params.models.teacher!r} and models.student {params.models.student!r}: one is the "
                "built-in model and the other a pretrained one, so their tokenizers differ; token-level distillation "
                "between them needs opd.cross_tokenizer: true",
            )
    if (
        params.ddp is not None
        and params.opd is not None
        and params.ddp.strategy == "fsdp"
        and params.opd.rollout_cache == "static"
    ):
        raise ConfigError(
            "opd.rollout_cache",
            "static rollouts stop each worker at its own EOS, and a sharded "
            "student (ddp.strategy: fsdp) needs every worker to run the same forwards; use dynamic",
        )
    if params.ddp is not None and params.opd is not None and params.ddp.strategy == "fsdp":
        if params.opd.rollout_dtype != "train":
            raise ConfigError(
                "opd.rollout_dtype",
                "a bf16 rollout copy needs the whole student in every worker, which a sharded student (ddp.strategy: "
                "fsdp) is not; use train",
            )
    if params.opd is not None and params.opd.rollouts == "engine" and params.opd.engine.transport == "nccl":
        # (nccl with the bundled engine is refused by RolloutEngineConfig itself)
        if params.ddp is not None and params.ddp.device == "cpu":
            raise ConfigError("opd.engine.transport", "nccl needs the trainer on CUDA (ddp.device); use filesystem")
    loops = [(name, getattr(params, name)) for name in ("sft", "opd") if getattr(params, name) is not None]
    if params.ddp is not None and loops and not launched_externally():
        workers = params.ddp.workers
        for name, cfg in loops:
            problem = batch_split_problem(cfg.global_batch_size, workers, cfg.micro_batch_size, name)
            if problem is not None:
                key = "global_batch_size" if cfg.global_batch_size % workers else "micro_batch_size"
                raise ConfigError(f"{name}.{key}", problem)


def _local_teacher_path(source: str, base: Path) -> Path | None:
    """A named teacher's source as a local path (relative to ``base``) when it is one, else None (a hub id)."""
    path_like = source.startswith((".", "/", "~")) or source.count("/") > 1 or is_gguf(source)
    return _looks_local(source, path_like, base)


def check_teachers(params: Params, base: str | Path = ".") -> None:
    """With teachers named (``teachers.named``), what the other sections must allow; ``ConfigError`` naming the key.

    - ``inputs.teachers``: a directory holding every local directory or .gguf file a named teacher is (one dep of
      the models stage for all of them), else ``inputs/none``;
    - every teacher shares the student's tokenizer: a built-in teacher (or the built-in ``models.teacher``) beside
      a pretrained student tokenises otherwise, and several teachers are offered on the student's tokenizer only
      (``opd.cross_tokenizer`` is refused with them; a pretrained teacher's tokenizer is compared with the
      student's by the models stage, which refuses a difference naming the teacher);
    - ``teacher_gen.endpoint`` stays local: each teacher's source says where it answers;
    - ``opd``: each teacher's source decides where it scores (``opd.teacher`` stays local); an endpoint teacher
      returns log-probabilities, not distributions, so the loss must not need logits; the forward_kl anchor needs
      one teacher's distribution on its own text and is not offered across several.
    """
    teachers, base = params.teachers, Path(base).resolve()
    if params.inputs is not None:
        local = [
            (i, t, _local_teacher_path(t.source, base))
            for i, t in enumerate(teachers.named)
            if t.source not in (BUILTIN, THE_TEACHER, ENDPOINT_SOURCE)
        ]
        local = [(i, t, path) for i, t, path in local if path is not None]
        value = params.inputs.teachers
        if not local:
            _require(
                value == INPUT_PLACEHOLDER,
                "inputs.teachers",
                f"no named teacher is a local file or directory, so there is nothing for DVC to hash: set "
                f"inputs.teachers: {INPUT_PLACEHOLDER} (got {value!r})",
            )
        for i, t, path in local:
            _require(path.exists(), f"teachers.named[{i}].source", f"no such file or directory: {t.source!r}")
            holder = Path(value) if Path(value).is_absolute() else base / value
            _require(
                value != INPUT_PLACEHOLDER and path.resolve().is_relative_to(holder.resolve()),
                "inputs.teachers",
                f"teachers.named[{i}] ({t.name}) is the local path {t.source!r}, which DVC must hash so that `dvc "
                f"status` reports the models stage as changed when it changes: set inputs.teachers to a directory "
                f"holding it, e.g. {str(path.parent)!r} (got {value!r})",
            )
    if params.models is not None:
        models = params.models
        pruned = models.pruned_student
        student_builtin = models.student == BUILTIN or (
            pruned is not None and pruned.prune_from == "teacher" and models.teacher == BUILTIN
        )
        student = models.student if isinstance(models.student, str) else "a pruned student"
        warmup = models.teacher_training.warmup_steps
        for i, t in enumerate(teachers.named):
            _require(
                t.steps is None or t.steps >= warmup,
                f"teachers.named[{i}].steps",
                f"must be >= models.teacher_training.warmup_steps ({warmup}), got {t.steps}: the learning rate would "
                "never reach its peak",
            )
        for i, t in enumerate(teachers.named):  # a pretrained one's tokenizer is compared by the models stage
            builtin = t.source == BUILTIN or (t.source == THE_TEACHER and models.teacher == BUILTIN)
            if builtin and not student_builtin:
                raise ConfigError(
                    f"teachers.named[{i}].source",
                    f"{t.name} ({t.source}) is a built-in teacher and the student ({student}) a pretrained one: they "
                    "tokenise differently, and several teachers are offered on the student's tokenizer only",
                )
    if params.teacher_gen is not None and params.teacher_gen.endpoint != LOCAL_ENDPOINT:
        raise ConfigError(
            "teacher_gen.endpoint",
            "with teachers.named each teacher's source says where it answers (source: endpoint for a served one); "
            "set teacher_gen.endpoint: local",
        )
    if params.opd is not None:
        opd = params.opd
        if opd.cross_tokenizer:
            raise ConfigError(
                "opd.cross_tokenizer",
                "several teachers (teachers.named) are offered on the student's tokenizer only; a teacher that "
                "tokenises otherwise is not supported beside others: set false, or name one teacher in models.teacher",
            )
        if opd.teacher != "local":
            raise ConfigError(
                "opd.teacher",
                "with teachers.named each teacher's source says where it scores (source: endpoint for a served one); "
                "set opd.teacher: local",
            )
        endpoints = [t.name for t in teachers.named if t.is_endpoint]
        if endpoints and RULES[opd.loss].teacher_signal == "logits":
            raise ConfigError(
                "opd.loss",
                f"the {opd.loss} loss needs each teacher's full distribution, which the endpoint teacher(s) "
                f"{', '.join(endpoints)} do not return; use sampled_token or topk",
            )
        if opd.anchor == "forward_kl":
            raise ConfigError(
                "opd.anchor",
                "the forward_kl anchor scores the teacher's text with one teacher's distribution; it is not offered "
                "with several teachers (teachers.named): use anchor: sft",
            )


def launched_externally() -> bool:
    """True inside a worker started by torchrun / accelerate launch (they set WORLD_SIZE, RANK and MASTER_ADDR).

    The one rule, asked by ``load_params`` (the batch split is then the launcher's world's), by
    ``ars_opd.training.distributed.launch`` (run here instead of starting workers) and by ``stages`` (no
    forkserver head start). All three of the launcher's variables, not WORLD_SIZE alone: a WORLD_SIZE left in
    the environment by something else does not make a process a worker of a world it cannot join, and the
    head start must be taken exactly when ``launch`` will start local workers."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "MASTER_ADDR" in os.environ


def batch_split_problem(global_batch: int, workers: int, micro_batch: int, section: str) -> str | None:
    """Why a global batch does not split over ``workers`` and then into micro-batches, or None if it does
    (``ars_opd.training.batch_plan.BatchGeometry.check`` refuses the same)."""
    if global_batch % workers:
        return f"{section}.global_batch_size = {global_batch} does not divide by ddp.workers = {workers}"
    if (global_batch // workers) % micro_batch:
        return (
            f"{section}.global_batch_size / ddp.workers = {global_batch // workers} does not divide by "
            f"{section}.micro_batch_size = {micro_batch}"
        )
    return None


def to_dict(cfg: Any) -> Any:
    """Plain, JSON-ready form of a config dataclass (for manifests and provenance)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg
