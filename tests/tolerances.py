"""Floating-point tolerances of the numeric tests, derived from the unit roundoff and the test's own shapes.

A bound here is a statement about rounding, never a number that one CPU happened to meet. The model:

- **Worst case, not probabilistic.** A sum of n terms computed in any order (left to right, pairwise, in
  blocks, split over threads or SIMD lanes) has error at most γ_{n−1}·Σ|x_i| (Higham, *Accuracy and
  Stability of Numerical Algorithms*, 2nd ed., §3.1 and §4.2; γ_n = n·u / (1 − n·u)): every term goes through
  at most n − 1 additions, whatever the tree. That is what a test needs to hold on a machine it was never run
  on: the summation order is exactly what changes with the CPU's vector width, the BLAS kernel and the
  thread count. The rule of thumb c·u·√n·Σ|x_i| describes typical rounding only and would put back the
  problem this module exists to remove. At the sizes of the losses and heads here (n up to a few hundred:
  vocabulary, hidden size, scored tokens) the worst case is √n ≈ 10–20 times the typical error and still
  far below the differences the tests exist to catch (a wrong temperature, a dropped token, a gradient off
  by a factor; test_numeric_portability.py checks two). Where n is a whole model's parameter count (the
  consistency statistics' squared norms, P ≈ 23,000) the worst case γ_P ≈ 1.4e-3 is loose, and stays so:
  a tighter number would rest on how PyTorch happens to block its reductions.
- **First order.** Products of two rounding errors (u² ≈ 4e-15 in fp32) are dropped.
- **Scalars through a float64 oracle graph** (``first_order_bound``): a value computed through several
  stages (logits, log-softmaxes, per-row sums, the sum over rows) has error at most Σ_stages Σ |∂f/∂x|·b_x,
  with b_x the stage's own rounding error (from the bounds below) and ∂f/∂x taken by autograd on the float64
  oracle. This is the standard first-order forward error analysis, computed instead of estimated.
- **Tensors through a network** (``chain_bound``): a gradient that passes through a transformer's forward
  and backward cannot be bounded element by element at a useful price. There the bound is
  Σ_k γ_{n_k}·scale over the reduction lengths n_k on the path (``decoder_lengths``), with scale the
  compared quantity's own size (its max |value|, or its 2-norm for a norm). That is a *model*: it assumes the
  layers pass an earlier stage's error on without gain beyond that scale (true of these normalised layers
  at initialisation, not proved). The worst-case n in place of the typical √n is the margin paid for that
  assumption. The same model gives the gradients of the log-softmax losses (``loss_grad_bound``), on the
  absolute size of their terms.
- **Two fp32 computations** that differ only in order or chunking are each within their bound of the exact
  value, so they are within the sum of both (``two_computations``). Against a float64 oracle the oracle's
  own error is the same bound at u = 2^-53, 2^-29 times smaller (``vs_oracle``).
- **Elementary functions**: exp, log, log1p in PyTorch's CPU kernels (SLEEF's 1-ulp variants, libm) are
  within 1 ulp, i.e. relative error at most 2u (``FN_ULPS``), not the u of a correctly rounded operation.

Bounds that are not rounding bounds (sampling frequencies, training outcomes, an estimator's own stated
error) stay in the tests with their reason next to them.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch

U32 = 2.0**-24  # fp32 unit roundoff (half fp32's epsilon 2^-23): a correctly rounded op's relative error <= u
U64 = 2.0**-53  # float64 unit roundoff
U_BF16 = 2.0**-8  # bf16 unit roundoff (8 significant bits)
FN_ULPS = 2  # exp / log / log1p: within 1 ulp, i.e. relative error <= 2u


def gamma(n: int, u: float = U32) -> float:
    """γ_n = n·u / (1 − n·u): the relative error bound of n successive roundings (Higham, Lemma 3.1)."""
    if n <= 0:
        return 0.0
    if n * u >= 1:
        raise ValueError(f"{n} roundings at u = {u} leave no bound (n·u >= 1)")
    return n * u / (1 - n * u)


def sum_bound(n: int, abs_sum, u: float = U32):
    """|fl(Σ x_i) − Σ x_i| for n terms with Σ|x_i| = ``abs_sum`` (a number or a tensor), in any order.

    γ_{n−1}·Σ|x_i| (Higham (4.6)): each term passes through at most n − 1 additions whatever the summation
    tree, so this holds for every blocking, vector width and thread split.
    """
    return gamma(n - 1, u) * abs_sum


def dot_bound(n: int, abs_dot, u: float = U32):
    """|fl(a·b) − a·b| for vectors of length n with Σ|a_i·b_i| = ``abs_dot``, in any order: γ_n·Σ|a_i b_i|.

    One rounding per product and at most n − 1 per term in the sum (Higham (3.5)); a fused multiply-add
    only removes roundings. A squared norm is the case a = b (``abs_dot`` = the squared norm itself).
    """
    return gamma(n, u) * abs_dot


def linear_bound(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, u: float = U32
) -> torch.Tensor:
    """Elementwise bound on |fl(x @ weightᵀ + bias) − exact| (``F.linear``'s shapes), as float64.

    Each output is a dot product of length k = x.shape[-1] (``dot_bound``); a bias adds one rounding and its
    own magnitude: γ_{k+1}·(|x| @ |weight|ᵀ + |bias|). Any blocking of the product (BLAS kernels, chunks of
    rows) is covered.
    """
    k = x.shape[-1]
    scale = x.detach().double().abs() @ weight.detach().double().abs().T
    if bias is None:
        return gamma(k, u) * scale
    return gamma(k + 1, u) * (scale + bias.detach().double().abs())


def log_softmax_bound(z: torch.Tensor, dim: int = -1, u: float = U32) -> torch.Tensor:
    """Elementwise bound on |fl(log_softmax(z)) − log_softmax(z)| for rows z (the fp32 input, any dtype).

    With m = max z, d_v = z_v − m, S = Σ exp(d_v), y_v = d_v − log S (1 <= S <= V, so 0 <= log S <= log V):
    the shift costs u·|d_v|; exp(d_v(1 + δ)) is exp(d_v)·(1 + d_v·δ) times a 2u function error, so S has
    relative error <= u·max|d| + 2u + γ_{V−1} (positive terms); log S then has absolute error <= that plus
    2u·log V; the last subtraction u·|y_v|. The other evaluation order in use, z − logsumexp(z) (the chunked
    path's), rounds m + log S and z − (m + log S) instead: u·(|m| + log V) + u·|y_v| more. The bound is the
    sum of both, so it holds for either:

        u·(|d_v| + max|d| + |y_v| + |m| + 3·log V + 2·FN_ULPS) + γ_{V−1}.

    Entries at −inf (a restricted support) have no value and get 0; V counts a row's finite entries at most.
    """
    z = z.detach().double()
    finite = torch.isfinite(z)
    V = z.shape[dim]
    m = z.amax(dim, keepdim=True)
    d = torch.where(finite, z - m, 0.0).abs()
    y = torch.where(finite, torch.log_softmax(z, dim), 0.0).abs()
    b = u * (d + d.amax(dim, keepdim=True) + y + m.abs() + 3 * math.log(V) + 2 * FN_ULPS) + gamma(V - 1, u)
    return torch.where(finite, b, 0.0)


def logprob_bound(z: torch.Tensor, z_bound: torch.Tensor | None = None, u: float = U32) -> torch.Tensor:
    """Elementwise bound on the fp32 log_softmax of fp32 logits whose own error is ``z_bound`` (None: exact).

    A logit error b reaches log-probability v as b_v − Σ_i q_i·b_i at first order, so at most b_v + Σ_i q_i b_i;
    the log-softmax's own rounding (``log_softmax_bound``) adds to it. z: the exact logits.
    """
    bound = log_softmax_bound(z, u=u)
    if z_bound is None:
        return bound
    b = z_bound.detach().double()
    return bound + b + (torch.softmax(z.detach().double(), -1) * b).sum(-1, keepdim=True)


def softmax_length(vocab: int, max_abs_logit: float) -> float:
    """The log-softmax's bound written as a number of roundings n (γ_n), for ``chain_bound``.

    In ``log_softmax_bound`` |d_v|, max|d| <= 2A and |y_v| <= 2A + log V for logits with |z| <= A, |m| <= A:
    at most u·(7A + 4·log V + 4) + γ_{V−1}, which is within γ_n for n = V + 7A + 4·log V + 4.
    """
    return vocab + 7 * max_abs_logit + 4 * math.log(vocab) + 4


def two_computations(bound_a, bound_b=None):
    """Two fp32 computations of one value, each within its bound of the exact value: within the sum."""
    return bound_a + (bound_a if bound_b is None else bound_b)


def vs_oracle(bound):
    """An fp32 result against a float64 oracle of the same formula: the fp32 bound plus the oracle's own,
    which is the same bound at u = 2^-53 (2^-29 times smaller: 2e-9 of it)."""
    return bound * (1 + U64 / U32)


@torch.enable_grad()
def first_order_bound(out: torch.Tensor, stages: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Σ over stages of Σ |∂out/∂x|·b: the first-order forward error of ``out`` given each stage's own error b.

    ``out`` is a float64 oracle value built by autograd from the intermediates x (each requires grad or is a
    non-leaf of the graph), one (x, b) per stage that rounds in the fp32 computation, b >= 0 elementwise of
    x's shape (a local bound: the error of computing x from exact inputs of that stage). ``out`` may be a
    scalar, or a vector (R,) of per-row values whose rows depend only on row r of every stage (dimension 0);
    then the result is a per-row bound (R,). Second-order terms (products of two rounding errors) are dropped.
    """
    xs = [x for x, _ in stages]
    grads = torch.autograd.grad(out.sum(), xs, retain_graph=True, allow_unused=True)
    total = torch.zeros(out.shape, dtype=torch.float64)
    for (x, b), g in zip(stages, grads):
        if g is None:
            continue
        term = torch.nan_to_num(g.detach().double().abs() * b, nan=0.0)  # -inf slots: no value, no error
        total = total + (term.sum() if out.dim() == 0 else term.reshape(out.shape[0], -1).sum(-1))
    return total


@torch.enable_grad()
def loss_bound(
    kind: str,
    zs: torch.Tensor,
    zs_bound: torch.Tensor | None = None,
    zt: torch.Tensor | None = None,
    zt_bound: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    beta: float = 1.0,
    tau: float = 1.0,
    rows: bool = False,
    teacher_logprobs: torch.Tensor | None = None,
    u: float = U32,
):
    """A float64 oracle of the pipeline's per-row losses from logits, and the first-order bound of their fp32 form.

    kind: "cross_entropy" (−log q(y)), "sampled_token" (log q(y) − log p(y), the reverse-KL estimate) or
    "divergence" (β = 0 forward KL(p‖q), β = 1 reverse KL(q‖p), between the generalised JSD), with
    q = softmax(zs / τ), p = softmax(zt / τ); zs, zt (R, V) the logits (−inf outside a restricted support;
    their exact values where known: the float64 product rather than the fp32 one), zs_bound / zt_bound the
    fp32 logits' own error (``linear_bound``; None for inputs taken as exact); a sampled-token loss may take the
    teacher's log p(y) as given (``teacher_logprobs`` (R,), exact inputs) instead of zt. Returns (value, bound): the
    float64 sum over the rows and the bound of its fp32 evaluation, or per-row (R,) values and bounds.

    The fp32 evaluation's local errors, stage by stage (``first_order_bound`` propagates them):
    - z / τ: one rounding, u·|z| (none at τ = 1), on top of the logits' own error;
    - the log-softmaxes: ``log_softmax_bound``;
    - a KL row Σ_v w_v·(a_v − b_v) with w = exp(a) (p or q): a subtraction, a product, exp's 2u and a sum of
      V terms: γ_{V+3}·Σ_v |w_v·(a_v − b_v)|;
    - the JSD's log m = logaddexp(x, y), x = log p + log β, y = log q + log(1 − β): the shifts (fp32 constants
      included) u·(|x| + |log β|) or u·(|y| + |log(1 − β)|), passed on with weights summing to 1; then
      max + log1p(exp(−|x − y|)): u·|x − y| (at a slope <= 1/2), 2u (exp), 2u·log 2 (log1p) and u·|log m|.
      Its row is two KL rows to m, scaled and added: γ_{V+5} on both rows' |terms|;
    - a sampled-token row: one subtraction, u·|value|; cross-entropy: a negation, exact;
    - the sum over the R rows, chunk by chunk in any order: ``sum_bound``.
    """

    def safe(x):  # −inf slots hold no mass: 0 in differences, without NaN gradients
        return torch.where(torch.isfinite(x), x, 0.0)

    def leaf(z, bound):
        z = z.detach().double().requires_grad_(True)
        own = torch.zeros_like(z) if bound is None else bound.detach().double()
        if tau != 1.0:
            own = own + u * safe(z.detach()).abs()
        return z, torch.where(torch.isfinite(z), own, 0.0)

    zs, b = leaf(zs, zs_bound)
    lq = torch.log_softmax(zs / tau, -1)
    stages = [(zs, b), (lq, log_softmax_bound(zs.detach() / tau, u=u))]
    if zt is not None:
        zt, b = leaf(zt, zt_bound)
        lp = torch.log_softmax(zt / tau, -1)
        stages += [(zt, b), (lp, log_softmax_bound(zt.detach() / tau, u=u))]
    V = zs.shape[-1]
    if kind == "cross_entropy":
        value = -lq.gather(-1, targets[:, None]).squeeze(-1)
    elif kind == "sampled_token":
        y = targets[:, None]
        lp_y = teacher_logprobs.double()[:, None] if zt is None else lp.gather(-1, y)
        value = (lq.gather(-1, y) - lp_y).squeeze(-1)
        stages.append((value, u * value.detach().abs()))
    elif kind == "divergence" and beta in (0.0, 1.0):
        w, a, c = (lp.exp(), lp, lq) if beta == 0.0 else (lq.exp(), lq, lp)
        terms = w * (safe(a) - safe(c))
        value = terms.sum(-1)
        stages.append((value, gamma(V + 3, u) * terms.detach().abs().sum(-1)))
    elif kind == "divergence":
        x, y = lp + math.log(beta), lq + math.log1p(-beta)
        lm = torch.logaddexp(x, y)
        shifts = torch.maximum(
            safe(x.detach()).abs() + abs(math.log(beta)), safe(y.detach()).abs() + abs(math.log1p(-beta))
        )
        own = u * (shifts + safe(x.detach() - y.detach()).abs() + safe(lm.detach()).abs() + 2 * FN_ULPS)
        stages.append((lm, torch.where(torch.isfinite(lm.detach()), own, 0.0)))
        tp = lp.exp() * (safe(lp) - safe(lm))
        tq = lq.exp() * (safe(lq) - safe(lm))
        value = beta * tp.sum(-1) + (1 - beta) * tq.sum(-1)
        stages.append(
            (value, gamma(V + 5, u) * (beta * tp.detach().abs().sum(-1) + (1 - beta) * tq.detach().abs().sum(-1)))
        )
    else:
        raise ValueError(f"unknown loss kind {kind!r}")
    if rows:
        return value.detach(), first_order_bound(value, stages)
    total = value.sum()
    stages.append((total, sum_bound(value.numel(), value.detach().abs().sum(), u)))
    return total.detach(), first_order_bound(total, stages)


def loss_grad_bound(
    kind: str,
    zs: torch.Tensor,
    zt: torch.Tensor | None = None,
    targets: torch.Tensor | None = None,
    beta: float = 1.0,
    tau: float = 1.0,
    teacher_logprobs: torch.Tensor | None = None,
    zs_bound: torch.Tensor | None = None,
    u: float = U32,
) -> torch.Tensor:
    """Elementwise bound on the fp32 gradient of ``loss_bound``'s per-row losses in the student's logits zs.

    A chain (``chain_bound``) of the log-softmax (``softmax_length``), the row sum over V that reverse KL
    and the JSD subtract, and about 8 elementwise operations, on the absolute size G of the gradient's terms,
    taken so that both evaluation orders in use (the analytic q ⊙ (h − ⟨q, h⟩)/τ and autograd's backward of
    the log-softmax) are covered: forward KL (q + p)/τ; reverse KL q·(|s| + |D| + 2)/τ with s = log q − log p;
    the JSD (1 − β)·q·(|h| + Σ q|h| + 2)/τ with h = log q − log m; cross-entropy q + onehot(y); the sampled-token
    surrogate (|A| + 2)·(q + onehot(y))/τ with A = log p(y) − log q(y). The 2s carry the log-probabilities'
    absolute errors (of size γ_n whatever the log-probability), which enter multiplied by q. An error b of the
    fp32 logits themselves (``zs_bound``: a product's, or the rounding of float64 inputs) reaches the
    log-probabilities with gain <= 2 (b_v + Σ q·b): 2·max(b/τ)/u more roundings in the chain. −inf logits (a
    restricted support) have q = 0 and get 0.
    """

    def safe(x):
        return torch.where(torch.isfinite(x), x, 0.0)

    zs = zs.detach().double()
    lq = torch.log_softmax(zs / tau, -1)
    q = lq.exp()
    A = safe(zs / tau).abs().max().item()
    if zt is not None:
        zt = zt.detach().double()
        lp = torch.log_softmax(zt / tau, -1)
        A = max(A, safe(zt / tau).abs().max().item())
    if kind in ("cross_entropy", "sampled_token"):
        onehot = torch.nn.functional.one_hot(targets, zs.shape[-1]).double()
    if kind == "cross_entropy":
        G = q + onehot
    elif kind == "sampled_token":
        y = targets[:, None]
        lp_y = teacher_logprobs.double()[:, None] if zt is None else lp.gather(-1, y)
        G = ((lp_y - lq.gather(-1, y)).abs() + 2) * (q + onehot) / tau
    elif beta == 0.0:
        G = (q + lp.exp()) / tau
    elif beta == 1.0:
        s = safe(lq) - safe(lp)
        G = q * (s.abs() + (q * s).sum(-1, keepdim=True).abs() + 2) / tau
    else:
        h = safe(lq) - safe(torch.logaddexp(lp + math.log(beta), lq + math.log1p(-beta)))
        G = (1 - beta) * q * (h.abs() + (q * h.abs()).sum(-1, keepdim=True) + 2) / tau
    lengths = [softmax_length(zs.shape[-1], A), zs.shape[-1], 8]
    if zs_bound is not None:
        lengths.append(2 * safe(zs_bound.detach().double() / tau).max().item() / u)
    return chain_bound(lengths, G, u)


def cross_entropy_grad_bound(
    z: torch.Tensor, targets: torch.Tensor, z_bound: torch.Tensor | None = None, u: float = U32
):
    """The exact gradient of Σ −log softmax(z)[y] in the logits, softmax(z) − onehot(y), and its fp32 error.

    z (M, V) the logits (their exact values), z_bound the fp32 logits' own error (None: exact inputs),
    targets (M,). Every implementation in use (the chunked terms' exp(z − logsumexp z), autograd's
    exp(log_softmax)) forms q_v = exp(y_v) from a log-probability y_v within ``log_softmax_bound`` of the
    log-softmax of its fp32 logits, which is itself within b_v + Σ_i q_i·b_i of the exact one (the
    log-softmax's first-order sensitivity to errors b in the logits); so q_v has relative error <= the sum of
    those + 2u (exp). Subtracting the one-hot adds u·|dz_v|.
    """
    z = z.detach().double()
    q = torch.softmax(z, -1)
    rel = log_softmax_bound(z, u=u) + FN_ULPS * u
    if z_bound is not None:
        b = z_bound.detach().double()
        rel = rel + b + (q * b).sum(-1, keepdim=True)
    dz = q - torch.nn.functional.one_hot(targets, z.shape[-1]).double()
    return dz, q * rel + u * dz.abs()


def head_grad_bound(
    h: torch.Tensor, weight: torch.Tensor, dz: torch.Tensor, dz_bound: torch.Tensor, u: float = U32, u_out: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elementwise bounds on a head's backward dL/dh = dz·W (M, H), dL/dW = dzᵀ·h (V, H), dL/db = Σ_rows dz.

    dz (M, V) is the exact gradient in the logits and dz_bound its error. Each output is a dot product
    (``dot_bound``: over V for dh, over the M rows for dW and db, chunked or not) of one erroneous factor:
    |δdz|·|W| + γ_V·|dz|·|W| (and |δdz|ᵀ·|h| + γ_M·|dz|ᵀ·|h|), plus ``u_out`` for the roundings of a result to
    a narrower dtype (bf16: 2^-8 per rounding, on at most the same |dz|·|W|). Returned as float64.
    """
    h, w = h.detach().double().abs(), weight.detach().double().abs()
    a = dz.abs()
    M, V = dz.shape
    bh = dz_bound @ w + (gamma(V, u) + u_out) * (a @ w)
    bw = dz_bound.T @ h + (gamma(M, u) + u_out) * (a.T @ h)
    bb = dz_bound.sum(0) + (gamma(M, u) + u_out) * a.sum(0)
    return bh, bw, bb


def chain_bound(lengths: Iterable[float], scale=1.0, u: float = U32):
    """Σ_k γ_{n_k}·scale for a computation whose value passes through reductions of lengths n_k (a model).

    Rigorous for one reduction (``sum_bound``); for a chain (a network's forward and backward) it assumes each
    stage passes on the error of the stages before it without gain beyond ``scale`` (see the module
    docstring). ``scale`` is the compared quantity's size in the norm the test compares in: its max |value|
    for an elementwise comparison, its 2-norm for a norm (a number, or a tensor of elementwise scales).
    Elementwise operations count as length 1 each.
    """
    return sum(gamma(math.ceil(n), u) for n in lengths) * scale


def decoder_lengths(config, seq_len: int) -> list[int]:
    """The reduction lengths of one pass (forward, or the backward's) through a decoder-only transformer.

    Per layer, from the Hugging Face ``config`` (Llama / Qwen3 layout): RMSNorm (H), the q/k/v projections
    (H), q·k (head_dim), the attention softmax and p·v (T each), o_proj (heads·head_dim), RMSNorm (H),
    gate/up (H), down (intermediate), and about ten elementwise operations (rotary, SiLU, residuals, the norms'
    scales); then the final norm (H). The backward runs the transposed products, which reduce over the same
    set of lengths; a caller adds each weight gradient's sum over the batch's positions.
    """
    H = config.hidden_size
    d = getattr(config, "head_dim", None) or H // config.num_attention_heads
    per_layer = [H, H, d, seq_len, seq_len, config.num_attention_heads * d, H, H, config.intermediate_size, 10]
    return per_layer * config.num_hidden_layers + [H]


def forward_bound(config, seq_len: int, max_abs_logit: float, vocab: int | None = None):
    """One fp32 forward of a decoder to its logits, or with ``vocab`` to its log-probabilities (a model).

    ``chain_bound`` over the decoder's reductions (``decoder_lengths``), the head's (H) and, for
    log-probabilities, the log-softmax's (``softmax_length``), on the logits' size (max |logit|): a bound on
    any entry, whatever the batch shape or attention kernel.
    """
    lengths = decoder_lengths(config, seq_len) + [config.hidden_size]
    if vocab is not None:
        lengths.append(softmax_length(vocab, max_abs_logit))
    return chain_bound(lengths, max_abs_logit)


def propagate(f, xs: Sequence[float], bounds: Sequence[float]) -> list[float]:
    """First-order bound on |f(x̂) − f(x)| for inputs within |x̂_i − x_i| <= b_i: Σ_i |∂f/∂x_i|·b_i.

    For a function of a few float64 scalars (a statistic computed from fp32 sums): each term is the larger of
    |f(x ± b_i·e_i) − f(x)|, the change over exactly the interval the error spans (for a smooth f its
    linearisation; a clamped f, such as a cosine held to [−1, 1], changes less). The float64 evaluations add
    ~1e-16 of f. ``f`` returns a number or a sequence of numbers; the result has one bound per output.
    """
    xs = [float(x) for x in xs]

    def call(v):
        out = f(v)
        return [float(out)] if isinstance(out, (int, float)) else [float(o) for o in out]

    at = call(xs)
    total = [0.0] * len(at)
    for i, b in enumerate(bounds):
        if b == 0:
            continue
        up, down = list(xs), list(xs)
        up[i] += b
        down[i] -= b
        total = [t + max(abs(a - c), abs(d - c)) for t, a, d, c in zip(total, call(up), call(down), at)]
    return total


def consistency_inputs(
    sq: Sequence[float], dot: Sequence[float] | None, mean_sq: float, n_params: int, u: float = U32
) -> tuple[list[float], list[float]]:
    """The inputs of ``consistency_metrics`` as one list, [‖g_k‖²..., ⟨g_k, ḡ⟩... (K > 2 only), ‖ḡ‖²], and
    their bounds (see ``consistency_bounds``)."""
    K = len(sq)
    norms = [math.sqrt(max(s, 0.0)) for s in sq]
    a = sum(norms) / K
    has_dot = K > 2 and dot is not None and not any(math.isnan(d) for d in dot)
    b_sq = [dot_bound(n_params + 3, s, u) for s in sq]
    b_dot = [gamma(n_params + 1, u) * n * math.sqrt(mean_sq) + gamma(K, u) * n * a for n in norms] if has_dot else []
    b_mean = 2 * gamma(K, u) * math.sqrt(mean_sq) * a + gamma(n_params, U64) * mean_sq
    return list(sq) + (list(dot) if has_dot else []) + [mean_sq], b_sq + b_dot + [b_mean]


def consistency_bounds(
    worker_loss: Sequence[float],
    sq: Sequence[float],
    dot: Sequence[float] | None,
    mean_sq: float,
    n_params: int,
    gram: torch.Tensor | None = None,
    u: float = U32,
) -> dict:
    """Bounds on the consistency hook's statistics against a float64 brute force on the same local gradients.

    The hook's inputs to ``consistency_metrics`` are fp32 sums over the P = ``n_params`` gradient entries
    (bucket by bucket, then over buckets; any order), bounded from the gradients' own norms (Cauchy–Schwarz
    turns Σ|a_i b_i| into ‖a‖·‖b‖; ā = Σ_k ‖g_k‖ / K bounds the 2-norm of Σ_k |g_k| / K):
    - ‖g_k‖²: a squared norm, one sqrt and one square: ``dot_bound`` (P + 3, ‖g_k‖²);
    - the reduced gradient ḡ = Σ_k fl(g_k / K), per entry within γ_K·Σ_k |g_k| / K (the division, K − 1 sums);
    - ⟨g_k, ḡ⟩ (K > 2): γ_{P+1}·‖g_k‖‖ḡ‖ for the products and sums, γ_K·‖g_k‖·ā for ḡ's own error;
    - ‖ḡ‖² (float64 of the fp32 ḡ): 2·γ_K·‖ḡ‖·ā from ḡ's error, γ_P at u = 2^-53 for its sum;
    - the workers' losses are the same float64 numbers on both sides.
    ``propagate`` carries these through the statistics (the Gram matrix, when given, is float64 of the same
    fp32 gradients on both sides). The brute force's own float64 error adds 4·γ_P(2^-53) of each value (of 1
    at least: a cosine from float64 dot products is within 3·γ_P of it, by Cauchy–Schwarz), and its
    loss dispersion is an fp32 std of K values: γ_{2K+4}·(max |loss| + std). Returns a dict of the statistics'
    bounds (a list for the per-worker ones).
    """
    from ars_opd.training.consistency import consistency_metrics

    K = len(sq)
    xs, bs = consistency_inputs(sq, dot, mean_sq, n_params, u)
    has_dot = len(xs) > K + 1
    scalars = ("loss_dispersion", "grad_norm_dispersion", "gradient_diversity", "grad_direction_consistency")
    lists = ("worker_grad_norm", "worker_cos_to_mean")

    def f(v):
        out = consistency_metrics(worker_loss, v[:K], v[K : 2 * K] if has_dot else dot, v[-1], gram)
        return [out[k] for k in scalars] + [x for k in lists for x in out[k]]

    values = f(xs)
    flat = propagate(f, xs, bs)
    oracle = 4 * gamma(n_params, U64)
    flat = [b + oracle * (max(1.0, abs(x)) if math.isfinite(x) else 0.0) for b, x in zip(flat, values)]
    std = values[0]
    flat[0] += gamma(2 * K + 4, u) * (max(abs(x) for x in worker_loss) + std)
    out = dict(zip(scalars, flat[: len(scalars)]))
    out["worker_grad_norm"], out["worker_cos_to_mean"] = flat[len(scalars) : len(scalars) + K], flat[len(scalars) + K :]
    return out
