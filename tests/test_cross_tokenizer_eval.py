"""Everything after the models stage but OPD training when teacher and student tokenize differently
(``opd.cross_tokenizer``): the evaluate stage (the teacher's row in its own tokens, the sampled cross-tokenizer
reverse-KL estimate against a float64 brute force, its reduction to the per-token log-ratio on shared tokens, the
score store's keys), the report's label, and teacher_gen serving the teacher with its own tokenizer.

The models directory is written by hand: a tiny Llama teacher and student, each saved with a character + word
tokenizer of its own (other whole words, so other ids; the teacher's with another chat template and another EOS),
``tokenizer/`` the student's, ``teacher_tokenizer/`` the teacher's, and ``cross_tokenizer: true`` in the manifest.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from ars_opd.artifacts import read_jsonl, write_json, write_jsonl
from ars_opd.config import ArchConfig, EvaluateConfig, load_params
from ars_opd.data import synthetic
from ars_opd.data.prompts import encode_completions, encode_prompts, encode_teacher_completions
from ars_opd.evaluation import evaluate as ev
from ars_opd.evaluation import token_losses
from ars_opd.evaluation.score_cache import ScoreCache, tokenizers_context
from ars_opd.evaluation.token_losses import (
    EXACT,
    SAMPLED_CROSS_TOKENIZER,
    own_samples,
    reverse_kl_cross_tokenizer,
    teacher_nll,
)
from ars_opd.lm.batching import build_rollout_batch, cut_at_first_eos
from ars_opd.lm.generation import decode_completion, eos_token_ids, generate_token_ids
from ars_opd.lm.head import OutputHead, last_hidden_states, select_rows, target_logprobs
from ars_opd.lm.token_alignment import UNALIGNED, CrossTokenizer
from ars_opd.models.builtin import build_causal_lm, save_builtin_model
from ars_opd.models.loading import builtin_ref, load_model, load_teacher_tokenizer, load_tokenizer
from ars_opd.models.tokenizer import PAD, build_char_word_tokenizer, tokenizer_fingerprint
from ars_opd.training.budget import write_budget
from micro import teacher_rows, write_micro_params
from tolerances import U64, forward_bound, sum_bound, vs_oracle

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
STUDENT_ARCH = ArchConfig(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
TEACHER_ARCH = ArchConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=64)
# the teacher's whole words: some the student has too (other ids), some the student spells letter by letter
TEACHER_WORDS = ["the", "cat", "sum", "numbers", "letters", "digits", "abc"]
# the teacher's own chat template and EOS: nothing of the student's ChatML
TEACHER_TEMPLATE = (
    "{% for message in messages %}[{{ message['role'] }}]: {{ message['content'] }}" + PAD + "\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant]: {% endif %}"
)


def student_tokenizer():
    return build_char_word_tokenizer(synthetic.instruction_words())


def teacher_tokenizer():
    tok = build_char_word_tokenizer(TEACHER_WORDS)
    tok.eos_token = PAD  # <|endoftext|>: the student ends at <|im_end|>
    tok.chat_template = TEACHER_TEMPLATE
    return tok


def write_models_dir(models_dir: Path, cross: bool = True) -> None:
    """A models stage's output by hand: the student's tokenizer as ``tokenizer/``; with ``cross`` the teacher saved
    with its own tokenizer, also in ``teacher_tokenizer/``, and the manifest's flag; without, both models with the
    student's tokenizer (a same-tokenizer run)."""
    s_tok = student_tokenizer()
    t_tok = teacher_tokenizer() if cross else s_tok
    models_dir.mkdir(parents=True)
    s_tok.save_pretrained(models_dir / "tokenizer")
    save_builtin_model(models_dir / "student", STUDENT_ARCH, s_tok, seed=1)
    save_builtin_model(models_dir / "teacher", TEACHER_ARCH, t_tok, seed=2)
    manifest = {
        "teacher": builtin_ref(models_dir, "teacher").to_json(),
        "student": builtin_ref(models_dir, "student").to_json(),
        "tokenizer": tokenizer_fingerprint(s_tok),
    }
    if cross:
        t_tok.save_pretrained(models_dir / "teacher_tokenizer")
        manifest["cross_tokenizer"] = True
        manifest["teacher_tokenizer"] = tokenizer_fingerprint(t_tok)
    write_json(models_dir / "manifest.json", manifest)


def _rows(n: int = 5) -> list[dict]:
    rows = teacher_rows(n, seed=3)
    rows[1]["finish_reason"] = "length"  # cut off: no EOS on either side
    return rows


def test_the_teachers_held_out_encoding_is_its_own_templates(tmp_path):
    write_models_dir(tmp_path / "models")
    s_tok, t_tok = load_tokenizer(tmp_path / "models"), load_teacher_tokenizer(tmp_path / "models")
    assert t_tok.chat_template == TEACHER_TEMPLATE and s_tok.chat_template != TEACHER_TEMPLATE
    rows = _rows()
    data = ev.held_out(s_tok, rows, t_tok)
    for r, student_prompt, teacher_prompt, teacher_completion in zip(
        rows, data.prompts, data.teacher.prompts, data.teacher.completions
    ):
        own = t_tok.apply_chat_template(r["messages"], tokenize=True, add_generation_prompt=True, return_dict=True)
        assert teacher_prompt == list(own["input_ids"])  # rendered by the teacher's template, in its ids
        assert t_tok.decode(teacher_prompt).startswith("[user]: ") and teacher_prompt != student_prompt
        text = t_tok(r["completion"], add_special_tokens=False)["input_ids"]
        assert teacher_completion == text + ([t_tok.eos_token_id] if r["finish_reason"] != "length" else [])
    assert data.prompts == encode_prompts(s_tok, [r["messages"] for r in rows])  # the students' as always
    assert data.completions == encode_teacher_completions(s_tok, rows)
    assert t_tok.eos_token_id != s_tok.eos_token_id
    # the teacher's encoding enters the data key; a head keeps it
    assert data.key != ev.held_out(s_tok, rows).key
    assert data.head(2).teacher.prompts == data.teacher.prompts[:2]


def _logprobs64(model, ids: list[int], start: int) -> tuple[torch.Tensor, float]:
    """log softmax of one unpadded row's fp32 logits in float64, gathered at ids[start:] (each predicted from the
    position before it), and the row's largest |logit|."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    return lp[torch.arange(start - 1, len(ids) - 1), torch.tensor(ids[start:])], logits.abs().max().item()


def _per_token_bound(model, seq_len: int, max_abs_logit: float, vocab: int) -> float:
    """|pipeline log-prob − oracle log-prob| of one token: the pipeline's fp32 forward to log-probabilities (a
    padded batch, the head in chunks, z − logsumexp z) and the oracle's fp32 forward to its logits (one unpadded
    row) whose error reaches the float64 log-softmax with gain <= 2 (first order: b_v + Σ q·b), each within its
    ``forward_bound`` of the exact value; the oracle's own float64 rounding (``vs_oracle``)."""
    pipeline = forward_bound(model.config, seq_len, max_abs_logit, vocab)
    oracle = 2 * forward_bound(model.config, seq_len, max_abs_logit)
    return vs_oracle(pipeline + oracle)


def _brute_force(model, teacher, s_tok, t_tok, prompts, teacher_prompts, samples, eos):
    """Per row: (Σ log q over the student's kept tokens − Σ log p over the teacher's tokens of their text, the
    student's token count, its rounding bound), every log-probability from its row alone in float64, the teacher's
    tokens spelled here (its tokenizer on the text, no special tokens, its EOS where the student ended)."""
    out = []
    width = max(len(p) + len(s) for p, s in zip(prompts, samples))
    teacher_width = 0
    rows = []
    for p, tp, s in zip(prompts, teacher_prompts, samples):
        kept, ended = cut_at_first_eos(s, eos)
        text = s_tok.decode(kept[:-1] if ended else kept, skip_special_tokens=True)
        t_ids = t_tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
        t_ids = list(t_ids) + ([t_tok.eos_token_id] if ended else [])
        rows.append((p, tp, kept, t_ids))
        teacher_width = max(teacher_width, len(tp) + len(t_ids))
    for p, tp, kept, t_ids in rows:
        lq, aq = _logprobs64(model, p + kept, len(p))
        lp, ap = _logprobs64(teacher, tp + t_ids, len(tp)) if t_ids else (torch.zeros(0, dtype=torch.float64), 0.0)
        bound = len(kept) * _per_token_bound(model, width, aq, len(s_tok))
        bound += len(t_ids) * _per_token_bound(teacher, teacher_width, ap, len(t_tok))
        # the pipeline's float64 sums of the fp32 values (the oracle's are 2^-29 of its own size, inside vs_oracle)
        bound += sum_bound(len(kept), lq.abs().sum().item(), U64) + sum_bound(len(t_ids), lp.abs().sum().item(), U64)
        bound += U64 * (lq.abs().sum() + lp.abs().sum()).item()  # the subtraction of the two sums
        out.append((float(lq.sum() - lp.sum()), len(kept), bound, t_ids))
    return out


def _handwritten_samples(s_tok) -> list[list[int]]:
    """Student completions that exercise the alignment: the teacher's words spelled letter by letter by the
    student, the student's words that the teacher spells letter by letter, a special token that covers no
    character mid-text, a completion cut off (no EOS), one that ends at once."""
    eos = s_tok.eos_token_id
    chars = s_tok.convert_tokens_to_ids(list("the cat"))
    words = s_tok("Reverse the letters", add_special_tokens=False)["input_ids"]
    special = s_tok.convert_tokens_to_ids("<|im_start|>")
    return [
        chars + [eos],
        words + [eos],
        s_tok("ab", add_special_tokens=False)["input_ids"]
        + [special]
        + s_tok("c 1", add_special_tokens=False)["input_ids"]
        + [eos, 7, 8],  # tokens after the EOS: cut away
        s_tok("sum 12", add_special_tokens=False)["input_ids"],  # no EOS
        [eos],
    ]


@pytest.mark.parametrize("samples_from", ["model", "handwritten"])
def test_cross_tokenizer_reverse_kl_equals_a_float64_brute_force(tmp_path, monkeypatch, samples_from):
    write_models_dir(tmp_path / "models")
    s_tok, t_tok = load_tokenizer(tmp_path / "models"), load_teacher_tokenizer(tmp_path / "models")
    model = load_model(tmp_path / "models", "student").eval()
    teacher = load_model(tmp_path / "models", "teacher").eval()
    rows = _rows()
    data = ev.held_out(s_tok, rows, t_tok)
    cfg = EvaluateConfig(batch_size=2, max_new_tokens=10, seed=5, chunk_size=3)
    eos = eos_token_ids(model, s_tok)
    if samples_from == "handwritten":
        fixed = _handwritten_samples(s_tok)
        monkeypatch.setattr(token_losses, "generate_token_ids", lambda *a, **k: [list(x) for x in fixed])
    samples, eos_used = own_samples(model, s_tok, data.prompts, cfg)  # the samples the estimate draws (seeded)
    assert eos_used == eos
    rkl = reverse_kl_cross_tokenizer(
        model, teacher, s_tok, t_tok, data.prompts, data.teacher.prompts, cfg, len(s_tok), len(t_tok), CPU
    )
    oracle = _brute_force(model, teacher, s_tok, t_tok, data.prompts, data.teacher.prompts, samples, eos)
    # both tokenizers spell every ASCII character, so every span closes at the text's end: every token is aligned,
    # on both sides, and the brute force sums every token
    assert rkl.unaligned == 0
    cross = CrossTokenizer(s_tok, t_tok, eos, t_tok.eos_token_id)
    for s, (_, _, _, t_ids) in zip(samples, oracle):
        a = cross.align(cut_at_first_eos(s, eos)[0])
        assert list(a.teacher_ids) == t_ids
        assert UNALIGNED not in a.alignment.student_span and UNALIGNED not in a.alignment.teacher_span
    assert rkl.row_counts == [n for _, n, _, _ in oracle]
    for got, (want, _, bound, _) in zip(rkl.row_sums, oracle):
        assert abs(got - want) <= bound, (got, want, bound)
    n = sum(rkl.row_counts)
    assert abs(rkl.mean - sum(w for w, *_ in oracle) / n) <= sum(b for _, _, b, _ in oracle) / n + 1e-15
    if samples_from == "handwritten":
        # the tokenisations do differ: "the cat" is 7 student tokens and 2 teacher ones ("the", " cat"), 8 and 3
        # with the ends; "Reverse the letters" 3 student words and the teacher's "Reverse" letter by letter, then
        # " the", " letters": 4 and 10 with the ends
        assert (rkl.row_counts[0], len(oracle[0][3])) == (8, 3)
        assert (rkl.row_counts[1], len(oracle[1][3])) == (4, len("Reverse") + 2 + 1)
        assert rkl.row_counts[2] == 2 + 1 + 3 + 1  # "ab", the special token (no text), "c 1", EOS; the rest cut
        assert oracle[4][3] == [t_tok.eos_token_id] and rkl.row_counts[4] == 1  # ended at once: the end span alone
        assert oracle[3][3][-1] != t_tok.eos_token_id  # cut off: no end on the teacher's side either


def test_text_the_teacher_cannot_spell_is_left_out_on_both_sides(tmp_path, monkeypatch):
    """A teacher whose tokenizer lowercases (its decoded tokens are not the text past the first capital): the
    estimate keeps the tokens before the last boundary both share and leaves out the rest, the end included, on
    both sides, and counts them."""
    from tokenizers import normalizers

    write_models_dir(tmp_path / "models")
    s_tok, t_tok = load_tokenizer(tmp_path / "models"), load_teacher_tokenizer(tmp_path / "models")
    t_tok.backend_tokenizer.normalizer = normalizers.Lowercase()
    model = load_model(tmp_path / "models", "student").eval()
    teacher = load_model(tmp_path / "models", "teacher").eval()
    rows = _rows(2)
    data = ev.held_out(s_tok, rows, load_teacher_tokenizer(tmp_path / "models"))
    eos = s_tok.eos_token_id
    fixed = [s_tok.convert_tokens_to_ids(list("ab Cd")) + [eos], s_tok.convert_tokens_to_ids(list("xy")) + [eos]]
    monkeypatch.setattr(token_losses, "generate_token_ids", lambda *a, **k: [list(x) for x in fixed])
    cfg = EvaluateConfig(batch_size=2, max_new_tokens=8, seed=0, chunk_size=2)
    rkl = reverse_kl_cross_tokenizer(
        model, teacher, s_tok, t_tok, data.prompts, data.teacher.prompts, cfg, len(s_tok), len(t_tok), CPU
    )
    # row 0: "ab " on both sides (3 tokens each: the teacher spells "ab cd" letter by letter too), then "C", "d" and
    # the end left out; row 1 whole, its end too
    assert rkl.row_counts == [3, 3] and rkl.unaligned == 3
    teacher_ids = [
        t_tok.convert_tokens_to_ids(list("ab ")),
        t_tok.convert_tokens_to_ids(list("xy")) + [t_tok.eos_token_id],
    ]
    width = max(len(p) + len(f) for p, f in zip(data.prompts, fixed))
    teacher_width = max(len(tp) for tp in data.teacher.prompts) + len("ab Cd") + 1  # the teacher's rows as scored
    for got, p, tp, f, t in zip(rkl.row_sums, data.prompts, data.teacher.prompts, fixed, teacher_ids):
        lq, aq = _logprobs64(model, p + f, len(p))
        lq = lq[:3]  # the student's kept tokens: "ab " of row 0, "xy" and the end of row 1
        lp, ap = _logprobs64(teacher, tp + t, len(tp))  # causal: the tokens after them change nothing before
        bound = 3 * _per_token_bound(model, width, aq, len(s_tok))
        bound += len(t) * _per_token_bound(teacher, teacher_width, ap, len(t_tok))
        q_abs, p_abs = lq.abs().sum().item(), lp.abs().sum().item()
        bound += sum_bound(3, q_abs, U64) + sum_bound(len(t), p_abs, U64) + U64 * (q_abs + p_abs)
        assert abs(got - float(lq.sum() - lp.sum())) <= bound


def test_identical_tokenizers_and_canonical_samples_give_the_per_token_log_ratio_sums(monkeypatch):
    """With the student's tokenizer on both sides and samples that are the tokenizer's own encoding of their text,
    the teacher's tokens are the student's, every span one token: each row's estimate is Σ_k log q(y_k) − log p(y_k)
    over the same tokens, as a shared-tokenizer per-token log ratio is."""
    tok = student_tokenizer()
    model = build_causal_lm(STUDENT_ARCH, tok, seed=1).eval()
    teacher = build_causal_lm(TEACHER_ARCH, tok, seed=2).eval()
    rows = _rows()
    prompts = encode_prompts(tok, [r["messages"] for r in rows])
    texts = ["Reverse the 12", "abc", "Count 3 letters", "x y z", ""]
    ended = [True, True, False, True, True]
    canonical = [
        ids + ([tok.eos_token_id] if e else []) for ids, e in zip(encode_completions(tok, texts, False), ended)
    ]
    monkeypatch.setattr(token_losses, "generate_token_ids", lambda *a, **k: [list(x) for x in canonical])
    cfg = EvaluateConfig(batch_size=3, max_new_tokens=16, seed=0, chunk_size=4)
    vocab = len(tok)
    rkl = reverse_kl_cross_tokenizer(model, teacher, tok, tok, prompts, prompts, cfg, vocab, vocab, CPU)
    eos = eos_token_ids(model, tok)
    cross = CrossTokenizer(tok, tok, eos, tok.eos_token_id)
    assert [list(cross.align(c).teacher_ids) for c in canonical] == canonical  # canonical: the same ids back
    # the shared-tokenizer per-token log ratios on the same batches: log q(y) − log p(y) at every sampled token
    want, bounds = [], []
    with torch.no_grad():
        for i in range(0, len(rows), 3):
            b = build_rollout_batch(prompts[i : i + 3], canonical[i : i + 3], tok.pad_token_id, eos)
            kw = (b["input_ids"], b["attention_mask"])
            y = b["targets"][b["loss_mask"]]
            hidden = [select_rows(last_hidden_states(m, *kw), b["loss_mask"]) for m in (model, teacher)]
            lq, lp = (
                target_logprobs(h, OutputHead.of(m, vocab), y, chunk_size=4)[0]
                for h, m in zip(hidden, (model, teacher))
            )
            ratio = (lq.double() - lp.double()).split(b["loss_mask"].sum(1).tolist())
            q_abs = lq.double().abs().split(b["loss_mask"].sum(1).tolist())
            p_abs = lp.double().abs().split(b["loss_mask"].sum(1).tolist())
            for r, qa, pa in zip(ratio, q_abs, p_abs):
                want.append(float(r.sum()))
                # the same fp32 log-probabilities (the same batches through the same ops), summed in float64 in
                # another order (Σ(q − p) against Σq − Σp): float64 rounding of both sums and the subtraction
                n = max(len(r), 1)
                bounds.append(
                    2 * sum_bound(2 * n, (qa.sum() + pa.sum()).item(), U64) + U64 * (qa.sum() + pa.sum()).item()
                )
    assert rkl.row_counts == [len(c) for c in canonical] and rkl.unaligned == 0
    for got, w, bound in zip(rkl.row_sums, want, bounds):
        assert abs(got - w) <= bound, (got, w, bound)


def test_score_cache_keys_differ_between_cross_and_shared_tokenizer_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # paths are relative to the repo root
    write_models_dir(tmp_path / "cross")
    write_models_dir(tmp_path / "shared", cross=False)
    # the student's tokenizer and student are the same bytes in both: only the teacher's side and the flag differ
    assert (tmp_path / "cross" / "tokenizer" / "tokenizer.json").read_bytes() == (
        tmp_path / "shared" / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    shared = tokenizers_context(tmp_path / "shared", cross=False)
    cross = tokenizers_context(tmp_path / "cross", cross=True)
    assert shared["tokenizer"] == cross["tokenizer"] and set(shared) == {"tokenizer"}
    assert cross["cross_tokenizer"] is True and cross["teacher_tokenizer"] != cross["tokenizer"]
    # the same tokenizers with the flag on (a cross run whose teacher happens to tokenize as the student does)
    same_pair = tokenizers_context(tmp_path / "shared", cross=True)
    assert same_pair != shared and same_pair["teacher_tokenizer"] == shared["tokenizer"]
    # the stage's whole context, and every key made under it: no key of one run is a key of the other, for the same
    # model names, and even for the same data key
    cfg = EvaluateConfig()
    rows = _rows()
    s_tok = load_tokenizer(tmp_path / "shared")
    shared_data = ev.held_out(s_tok, rows)
    keys = {}
    for root in ("shared", "cross"):
        paths = dataclasses.replace(load_params(_params(tmp_path)).paths, models_dir=root)
        store = ScoreCache(tmp_path / "scores", ev._cache_context(cfg, paths, False, CPU))
        t_tok = load_teacher_tokenizer(tmp_path / root) if root == "cross" else None
        data = ev.held_out(s_tok, rows, t_tok)
        keys[root] = {
            store.key(model, d.key, is_teacher)
            for model, is_teacher in (("pinned:student:x", False), ("pinned:teacher:y", True))
            for d in (data, shared_data, data.teacher or data)
        }
    assert keys["shared"] and keys["cross"] and not keys["shared"] & keys["cross"]


def _params(tmp_path: Path) -> str:
    path = tmp_path / "params.yaml"
    if not path.exists():
        write_micro_params(REPO, path)
    return str(path)


def _budget(steps: int) -> dict:
    """A stand-in model's budget.json (as test_evaluation's)."""
    return {
        "steps": steps,
        "flops": 1e9 * steps,
        "tokens_trained": 1,
        "tokens_processed": 1,
        "tokens_generated": 0,
        "teacher_tokens": 0,
    }


def test_evaluate_stage_in_a_cross_tokenizer_run(tmp_path, monkeypatch):
    """The whole stage: students in the student's tokens, the teacher's row in its own (its answers are its own
    greedy decode of its own prompts, its teacher NLL per its own tokens), the kind recorded and labelled in the
    table, the report and the run summary."""
    write_micro_params(REPO, tmp_path / "params.yaml")
    monkeypatch.chdir(tmp_path)
    p = load_params("params.yaml")
    models = Path(p.paths.models_dir)
    write_models_dir(models)
    rows = _rows(6)
    Path(p.paths.teacher_dir).mkdir(parents=True)
    write_jsonl(p.paths.completions("eval"), rows)
    for stage, steps in (("sft", 5), ("opd", 10), ("sft_continued", 10)):
        model_dir = Path(p.paths.training(stage).model)
        load_model(models, "student").save_pretrained(model_dir)
        write_budget(model_dir, _budget(steps))
    cfg = dataclasses.replace(
        p.evaluate, max_examples=0, curve_examples=3, max_new_tokens=8, batch_size=4, threads=1, device="cpu"
    )
    m = ev.evaluate_models(cfg, p.paths)
    assert m["reverse_kl_kind"] == SAMPLED_CROSS_TOKENIZER
    for name in ("base", "sft", "opd", "sft_continued", "teacher"):
        assert m[name]["reverse_kl_kind"] == SAMPLED_CROSS_TOKENIZER
        assert math.isfinite(m[name]["reverse_kl"]) and m[name]["teacher_nll"] > 0
    assert m["teacher"]["reverse_kl"] == 0.0 and m["base"]["reverse_kl_unaligned_tokens"] == 0
    # the stand-ins are the base student: the same weights, samples and scores
    assert m["sft"]["reverse_kl"] == m["base"]["reverse_kl"] and m["opd"]["teacher_nll"] == m["base"]["teacher_nll"]
    s_tok, t_tok = load_tokenizer(models), load_teacher_tokenizer(models)
    teacher, student = load_model(models, "teacher").eval(), load_model(models, "student").eval()
    t_prompts = encode_prompts(t_tok, [r["messages"] for r in rows])
    t_eos = eos_token_ids(teacher, t_tok)
    assert t_eos == (t_tok.eos_token_id,)  # <|endoftext|>, not the student's <|im_end|>
    greedy = generate_token_ids(teacher, t_tok, t_prompts, 8, batch_size=4, eos_ids=t_eos)
    answers = read_jsonl(Path(p.paths.eval_dir) / "answers.jsonl")
    assert [a["teacher"] for a in answers] == [decode_completion(t_tok, g, t_eos) for g in greedy]
    s_greedy = generate_token_ids(
        student,
        s_tok,
        encode_prompts(s_tok, [r["messages"] for r in rows]),
        8,
        4,
        eos_ids=eos_token_ids(student, s_tok),
    )
    assert [a["base"] for a in answers] == [
        decode_completion(s_tok, g, eos_token_ids(student, s_tok)) for g in s_greedy
    ]
    nll = teacher_nll(teacher, t_tok, t_prompts, encode_teacher_completions(t_tok, rows), cfg, len(t_tok), CPU)
    assert m["teacher"]["teacher_nll"] == nll.mean  # per the teacher's own tokens of its text
    # the students' estimate, from the stage's own function on the same samples
    data = ev.held_out(s_tok, rows, t_tok)
    rkl = reverse_kl_cross_tokenizer(
        student, teacher, s_tok, t_tok, data.prompts, data.teacher.prompts, cfg, len(s_tok), len(t_tok), CPU
    )
    assert m["base"]["reverse_kl"] == rkl.mean
    assert [c["reverse_kl"] for c in m["curves"]["opd"]][0] == m["curves"]["sft"][-1]["reverse_kl"]
    table = (Path(p.paths.eval_dir) / "table.md").read_text()
    assert ev.SAMPLED_NOTE in table
    # the report and the run summary say which reverse KL they show, and do not crash on it
    from ars_opd.evaluation.report import build_report, reverse_kl_note
    from ars_opd.evaluation.run_summary import render_summary

    md, flat, _ = build_report({}, m, p.report)
    assert "sampled cross-tokenizer estimate" in md and flat["eval/base/reverse_kl"] == m["base"]["reverse_kl"]
    assert "sampled cross-tokenizer estimate" in render_summary(p.paths, "pytest", "t")
    assert reverse_kl_note({**m, "reverse_kl_kind": EXACT}) == [] and reverse_kl_note({"base": {}}) == []


def test_teacher_gen_serves_the_teacher_with_its_own_tokenizer(tmp_path):
    """The bundled server loads the tokenizer of the teacher's model directory: in a cross-tokenizer run that must
    be the teacher's own (``teacher_tokenizer/``), and the stage refuses one that is the student's."""
    from ars_opd.models.loading import model_path
    from ars_opd.teacher.client.generate import TeacherGenerationError, check_served_tokenizer

    write_models_dir(tmp_path / "models")
    teacher_dir = model_path(tmp_path / "models", "teacher")
    check_served_tokenizer(str(tmp_path / "models"), teacher_dir)  # the teacher's own: served as is
    wrong = tmp_path / "wrong"
    save_builtin_model(wrong, TEACHER_ARCH, student_tokenizer(), seed=2)
    with pytest.raises(TeacherGenerationError, match="vocabulary, chat template, EOS token differ"):
        check_served_tokenizer(str(tmp_path / "models"), str(wrong))
    write_models_dir(tmp_path / "shared", cross=False)  # one shared tokenizer: nothing to check
    check_served_tokenizer(str(tmp_path / "shared"), str(wrong))
    assert json.loads((tmp_path / "models" / "manifest.json").read_text())["cross_tokenizer"] is True


@pytest.mark.parametrize("kind, flagged", [("exact", True), ("sampled_cross_tokenizer", False)])
def test_ars_opd_check_accepts_a_negative_sampled_reverse_kl_only(tmp_path, kind, flagged):
    """An exact KL below 0 is a bug; the cross-tokenizer estimate (a mean of log q - log p over samples) may be."""
    import json

    from ars_opd.checks import Problems, _metrics

    path = tmp_path / "evaluate.json"
    path.write_text(json.dumps({"reverse_kl_kind": kind, "opd": {"reverse_kl": -0.02, "exact_match": 0.5}}))
    problems = Problems()
    _metrics(path, problems)
    assert any("reverse_kl" in p for p in problems) == flagged
