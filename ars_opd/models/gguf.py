"""A GGUF file (llama.cpp's single-file format, quantized or not) as a model source of the ``models`` stage.

Real instruction-tuned models are often shipped only as GGUF: a PyPI wheel, a llama.cpp download. transformers
reads them itself (``from_pretrained(directory, gguf_file=name)``, with the ``gguf`` package installed) and
dequantizes every tensor to fp32; that is the one reader used here, so a file it cannot read is refused, not
half-read by a parser of ours.

The loaded model cannot be used as it is by the rest of the pipeline: transformers marks it as quantized
(``quantization_config: {quant_method: gguf}``) and refuses to ``save_pretrained`` it, every later stage and
the bundled server load directories, and vLLM's CPU build serves directories. So ``convert_gguf`` writes a
plain HF directory: the same architecture's config without the quantization entry, the dequantized weights as
fp32 safetensors (loaded into a model built from that config, strictly: every tensor accounted for), the
tokenizer with its chat template, and the generation config (its EOS and padding ids). The models stage pins
the GGUF by its file's sha256 and the written directory by the sha256 of its files, like a built-in model.

What it leaves out: GGUF files split into shards (``-00001-of-0000N.gguf``), architectures transformers cannot
read from GGUF (refused naming the file and transformers' reason), and keeping the quantization: the
pipeline trains and scores in fp32, so the dequantized weights are the model from here on.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from ars_opd.models.loading import ModelSourceError

GGUF_MAGIC = b"GGUF"


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _check_file(path: Path) -> None:
    """Refuse, naming the file, what cannot be a GGUF model before transformers spends time on it."""
    if not path.is_file():
        raise ModelSourceError(f"GGUF model {path} does not exist or is not a file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ModelSourceError(
            f"{path} is not a GGUF file: it starts with {magic!r}, not the GGUF magic {GGUF_MAGIC!r} "
            "(a download cut short, or another format renamed .gguf)"
        )
    try:
        import gguf  # noqa: F401  (transformers' GGUF reader needs it)
    except ImportError:
        raise ModelSourceError(
            f"reading {path} needs the gguf package, which is not installed in this environment: "
            "`pip install gguf==0.19.0` (`make repro-real` installs it)"
        ) from None


def load_gguf(path: str | Path, trust_remote_code: bool = False):
    """(model in fp32, tokenizer) from a GGUF file, through transformers' own GGUF support; any failure is a
    ``ModelSourceError`` naming the file and the reason, on one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path).expanduser().resolve()
    _check_file(path)
    where, name = str(path.parent), path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, dtype=torch.float32, trust_remote_code=trust_remote_code
        )
    except Exception as e:  # transformers' reader: unsupported architecture, a torn or corrupt file, ...
        reason = " ".join(f"{type(e).__name__}: {e}".split())[:400]
        raise ModelSourceError(f"cannot read the GGUF model {path}: {reason}") from None
    return model, tokenizer


def plain_model(model):
    """The same weights in a model built from the architecture's plain config: no quantization entry, fp32, so
    ``save_pretrained`` writes an ordinary directory. Strict: a tensor missing or left over is an error.

    The plain model's parameters are made on the meta device (accelerate's ``init_empty_weights``; buffers such as
    the rotary frequencies are computed as usual) and then take the GGUF model's own tensors (``assign``), not
    copies: one copy of the weights is in memory, not two. A 1.5B model is 7 GB in fp32, and the copy made a
    conversion's peak 14 GB, more than a 24 GB machine running anything else can give."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    config_dict = model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict["dtype"] = "float32"
    config = type(model.config).from_dict(config_dict)
    with init_empty_weights(include_buffers=False):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False, assign=True)
    tied = {k for k in missing if k in _tied_keys(plain)}
    if set(missing) - tied or unexpected:
        raise ModelSourceError(
            f"the GGUF model's tensors do not fit its own architecture ({type(plain).__name__}): missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    plain.tie_weights()
    empty = [name for name, p in plain.named_parameters() if p.is_meta]
    if empty:  # a tied key whose tie did not happen: it would be saved as nothing
        raise ModelSourceError(f"the GGUF model left {empty[:5]} of {type(plain).__name__} without weights")
    plain.generation_config = model.generation_config
    return plain.eval()


def _tied_keys(model) -> set[str]:
    keys = getattr(model, "_tied_weights_keys", None) or {}
    return set(keys) if not isinstance(keys, dict) else set(keys)


def convert_gguf(path: str | Path, out: str | Path, trust_remote_code: bool = False) -> dict:
    """Write the GGUF model at ``path`` as a plain fp32 HF directory ``out`` (config, safetensors, tokenizer,
    chat template, generation config); returns what the manifest records of it (the file, its sha256, its
    size, the architecture and parameter count)."""
    path = Path(path).expanduser().resolve()
    model, tokenizer = load_gguf(path, trust_remote_code)
    if not tokenizer.chat_template:
        raise ModelSourceError(
            f"the GGUF model {path} carries no chat template; prompts are rendered with it, so choose an "
            "instruct/chat model"
        )
    plain = plain_model(model)
    out = Path(out)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return {
        "gguf_file": str(path),
        "gguf_sha256": file_sha256(path),
        "gguf_bytes": path.stat().st_size,
        "architecture": type(plain).__name__,
        "parameters": sum(p.numel() for p in plain.parameters()),
    }
