"""Draft-head losses, each written once, on fused vocabulary projections.

No function here materialises ``[tokens, vocab]`` logits for the whole batch except the ``plain_*``
references used by parity tests and the memory benchmark:

* on CUDA: Liger's Triton ops (``LigerFusedLinearCrossEntropyLoss``; ``LigerFusedLinearJSD`` with
  beta = 0, i.e. forward KL);
* elsewhere: chunked torch autograd functions that compute the gradients chunk by chunk during the
  forward pass (the same scheme as Liger's ``chunked_loss``), so peak memory is one chunk of logits.
  A chunk's softmax arithmetic is one pure function per loss (``_*_math``); ``impl="compiled"`` runs it
  through ``torch.compile``, which fuses its passes over the chunk (the projections stay matmuls).

Soft targets use forward KL(p_target || q_draft) = soft cross-entropy minus the target's entropy, a
constant: the gradients equal soft-CE's, and 0 means a perfect match.

Label shifts are written once, in :func:`future_mask`: a loss term at position t that predicts the
token at t + d is kept when that token is an assistant (loss-masked) token of the same document.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from draftheads.kernels.linear_argmax import linear_argmax

IGNORE_INDEX = -100
IMPLS = ("auto", "liger", "chunked", "compiled")
"""``impl`` of the losses: ``auto`` (Liger on CUDA, chunked torch elsewhere), ``liger``, ``chunked``, or
``compiled`` (chunked, its per-chunk arithmetic compiled by torch.compile)."""
DEFAULT_CHUNK = 1024


# ----------------------------------------------------------------------------- label shifts


def future_mask(loss_mask: torch.Tensor, doc_ids: torch.Tensor, d: int) -> torch.Tensor:
    """[B, T] bool: position t predicts token t + d, which is in the loss mask and in t's document."""
    b, t = loss_mask.shape
    out = torch.zeros(b, t, dtype=torch.bool, device=loss_mask.device)
    if d < t:
        out[:, : t - d] = loss_mask[:, d:].bool() & (doc_ids[:, d:] == doc_ids[:, : t - d])
    return out


def shift_left(x: torch.Tensor, d: int, fill=0) -> torch.Tensor:
    """x[:, t + d] at position t (dim 1), ``fill`` past the end."""
    if d == 0:
        return x
    out = torch.full_like(x, fill)
    if d < x.shape[1]:
        out[:, : x.shape[1] - d] = x[:, d:]
    return out


# ----------------------------------------------------------------------------- chunked torch path


def _chunk_logits(pairs, s: int, chunk: int) -> torch.Tensor:
    """float32 logits [chunk, V] of rows s .. s + chunk: sum_i h_i @ w_i.T over the (input, weight) pairs
    (.float() copies only low precision)."""
    logits = None
    for h, w in pairs:
        part = h[s : s + chunk] @ w.T
        logits = part if logits is None else logits.add_(part)
    return logits.float()


def _chunked_forward(ctx, pairs, chunk: int, denom: float, loss_and_dlogits, n_extra: int, need=None):
    """Shared forward of the fused functions. Logits are ``sum_i h_i @ w_i.T`` over ``pairs`` of
    (input [N, H_i], weight [V, H_i]) -- one pair, or a second one for a low-rank bias; per chunk of rows,
    ``loss_and_dlogits(start, logits)`` returns (summed loss, d loss / d logits), and the gradients of
    the inputs and weights that need one accumulate right away, so one chunk of logits is alive at a
    time. The autograd inputs are the pairs' tensors in order (h_0, w_0, h_1, w_1, ...), then
    ``n_extra`` others (``need``: which pair tensors take a gradient, default ``ctx.needs_input_grad``);
    ``backward`` only scales the gradients."""
    need = ctx.needs_input_grad if need is None else need
    grads = []
    for i, (h, w) in enumerate(pairs):
        grads.append(torch.zeros_like(h) if need[2 * i] else None)
        grads.append(torch.zeros_like(w, dtype=torch.float32) if need[2 * i + 1] else None)
    n = pairs[0][0].shape[0]
    total = torch.zeros((), dtype=torch.float32, device=pairs[0][0].device)
    for s in range(0, n, chunk):
        loss, g = loss_and_dlogits(s, _chunk_logits(pairs, s, chunk))
        total += loss
        g = g.div_(denom)
        for i, (h, w) in enumerate(pairs):
            if grads[2 * i] is not None:
                grads[2 * i][s : s + chunk] = (g.to(w.dtype) @ w).to(h.dtype)
            if grads[2 * i + 1] is not None:
                grads[2 * i + 1] += g.T @ h[s : s + chunk].float()
    ctx.save_for_backward(*[g if g is not None else torch.empty(0) for g in grads])
    ctx.has = [g is not None for g in grads]
    ctx.dtypes = [t.dtype for pair in pairs for t in pair]
    ctx.n_extra = n_extra
    return total / denom


def _chunked_backward(ctx, go):
    out = tuple((g * go).to(dt) if has else None for g, has, dt in zip(ctx.saved_tensors, ctx.has, ctx.dtypes))
    return out + (None,) * ctx.n_extra


@functools.cache
def _compiled(math):
    """``math`` compiled once for any number of rows."""
    return torch.compile(math, dynamic=True)


def _runner(math, impl: str):
    """A chunk's arithmetic as ``impl`` runs it: compiled, or eagerly."""
    return _compiled(math) if impl == "compiled" else math


def _ce_math(logits, labels, scale):
    """One chunk of CE: (sum of scale * -log q[label], its gradient wrt the logits); logits [n, V] float32,
    labels [n] (valid ids), scale [n] (0 for ignored rows)."""
    log_q = logits - torch.logsumexp(logits, -1, keepdim=True)
    loss = -(log_q.gather(1, labels[:, None])[:, 0] * scale).sum()
    grad = log_q.exp_().mul_(scale[:, None])  # in log_q's buffer
    return loss, grad.scatter_add_(1, labels[:, None], -scale[:, None])


def _ce_chunks(labels, row_weights=None, impl: str = "chunked"):
    """CE per chunk of rows: (summed loss, d loss / d logits); ``row_weights`` [N] scale each row's term
    (the mean is still over the valid rows)."""
    valid = labels != IGNORE_INDEX
    safe = labels.clamp(min=0)
    scale = valid.float() if row_weights is None else valid.float() * row_weights.detach().float()
    math = _runner(_ce_math, impl)

    def ce(s, logits):
        return math(logits, safe[s : s + len(logits)], scale[s : s + len(logits)])

    return ce, max(int(valid.sum()), 1)


def _linear_teacher(ht, wt):
    """The teacher's log-probs of rows s .. s + n, computed from its inputs [N, Ht] and weight [V, Ht]."""

    def log_p(s, n):
        t = (ht[s : s + n] @ wt.T).float()
        return t.sub_(torch.logsumexp(t, -1, keepdim=True))

    return log_p


def _table_teacher(table, rows):
    """The teacher's log-probs of rows s .. s + n, read from ``table`` [M, V] at ``rows`` [N] (a copy)."""
    return lambda s, n: table[rows[s : s + n]]


def _kl_math(logits, log_p):
    """One chunk of KL(p || q): (the sum over its rows, its gradient q - p wrt the student logits, the
    student's top token per row); logits [n, V] and the teacher's log-probs log_p [n, V], float32."""
    log_q = logits - torch.logsumexp(logits, -1, keepdim=True)
    p = log_p.exp()
    loss = p.view(-1) @ (log_p - log_q).view(-1)
    return loss, log_q.exp_().sub_(p), logits.argmax(-1)  # the gradient in log_q's buffer


def _kl_chunks(teacher, argmax=None, impl: str = "chunked"):
    """KL(p_teacher || q_student) per chunk of rows, and its gradient wrt the student logits; ``teacher(s,
    n)`` gives the float32 log-probs of rows s .. s + n. Fills ``argmax`` [N], when given, with the
    student's top token."""
    math = _runner(_kl_math, impl)

    def kl(s, logits):
        loss, grad, top = math(logits, teacher(s, len(logits)))
        if argmax is not None:
            argmax[s : s + len(logits)] = top
        return loss, grad

    return kl


def _chunked_loss_only(pairs, chunk: int, denom: float, loss_and_dlogits):
    """The forward of the fused functions without their gradient matmuls (validation, no_grad)."""
    n = pairs[0][0].shape[0]
    total = torch.zeros((), dtype=torch.float32, device=pairs[0][0].device)
    for s in range(0, n, chunk):
        total += loss_and_dlogits(s, _chunk_logits(pairs, s, chunk))[0]
    return total / denom


def _needs_grad(*ts) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in ts)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, labels, row_weights, chunk: int, impl: str):
        # h [N, H], w [V, H], labels [N] with IGNORE_INDEX, row_weights [N] or None; mean CE over valid rows
        ce, denom = _ce_chunks(labels, row_weights, impl)
        return _chunked_forward(ctx, [(h, w)], chunk, denom, ce, n_extra=4)

    backward = staticmethod(_chunked_backward)


class _ChunkedLinearKL(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, teacher, chunk: int, argmax, impl: str):
        # student hs [N, H], ws [V, H]; teacher(s, n): log-probs of rows s .. s + n; mean over N of
        # KL(p_t || q_s); argmax [N] or None: filled with the student's top tokens
        return _chunked_forward(ctx, [(hs, ws)], chunk, max(hs.shape[0], 1), _kl_chunks(teacher, argmax, impl),
                                n_extra=4)

    backward = staticmethod(_chunked_backward)


def _block_math(logits, teacher_logits, labels, valid, ce_weight: float, tv_weight: float, kl_weight: float):
    """One chunk of ce_weight * CE(labels) + tv_weight * TV(p, q) + kl_weight * KL(p || q): (the sum over
    its rows, its gradient wrt the student logits, sum_x min(p, q) = 1 - TV per row, the student's top
    token per row); logits and teacher_logits [n, V] float32, labels [n] (valid ids), valid [n] float
    (0: no CE term). d TV / d z_k = q_k (s_k - sum_j s_j q_j) / 2 with s = sign(q - p)."""
    # in-place steps reuse this function's own buffers (never its inputs): few chunk-sized buffers when eager
    log_q = logits - torch.logsumexp(logits, -1, keepdim=True)
    log_p = teacher_logits - torch.logsumexp(teacher_logits, -1, keepdim=True)
    p = log_p.exp()
    loss = -ce_weight * (log_q.gather(1, labels[:, None])[:, 0] * valid).sum()
    if kl_weight:
        loss = loss + kl_weight * (p.view(-1) @ log_p.sub_(log_q).view(-1))
    q = log_q.exp_()
    grad = (q - p).sign_()  # s, then the gradient in its buffer
    tv_rows = 0.5 * (q - p).abs_().sum(-1)
    loss = loss + tv_weight * tv_rows.sum()
    grad.sub_((grad * q).sum(-1, keepdim=True)).mul_(q).mul_(0.5 * tv_weight)
    if kl_weight:
        grad.add_(q, alpha=kl_weight).sub_(p, alpha=kl_weight)
    if ce_weight:
        grad.addcmul_(q, valid[:, None], value=ce_weight).scatter_add_(1, labels[:, None], -ce_weight * valid[:, None])
    return loss, grad, 1.0 - tv_rows, logits.argmax(-1)


def _block_chunks(ht, wt, labels, ce_weight: float, tv_weight: float, kl_weight: float, accept, argmax,
                  impl: str = "chunked"):
    """:func:`_block_math` per chunk of rows, the teacher's logits from its inputs ``ht`` [N, Ht] and
    weight ``wt`` [V, Ht]; fills ``accept`` [N] with sum_x min(p, q) = 1 - TV (the probability that
    rejection sampling accepts the draft) and ``argmax`` [N] with the student's top token."""
    valid = (labels != IGNORE_INDEX).float()
    safe = labels.clamp(min=0)
    math = _runner(_block_math, impl)

    def block(s, logits):
        n = len(logits)
        teacher_logits = (ht[s : s + n] @ wt.T).float()
        loss, grad, accept_rows, top = math(logits, teacher_logits, safe[s : s + n], valid[s : s + n],
                                            ce_weight, tv_weight, kl_weight)
        accept[s : s + n], argmax[s : s + n] = accept_rows, top
        return loss, grad

    return block


class _ChunkedLinearBlock(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hs, ws, es, we, ht, wt, labels, weights, chunk: int, impl: str):
        # student logits hs @ ws.T + es @ we.T (es [N, r], we [V, r]: a low-rank bias, or empty)
        accept = torch.empty(hs.shape[0], dtype=torch.float32, device=hs.device)
        argmax = torch.empty(hs.shape[0], dtype=torch.int64, device=hs.device)
        pairs = [(hs, ws), (es, we)] if es.numel() else [(hs, ws)]
        loss = _chunked_forward(ctx, pairs, chunk, max(hs.shape[0], 1),
                                _block_chunks(ht, wt, labels, *weights, accept, argmax, impl), n_extra=6,
                                need=ctx.needs_input_grad[: 2 * len(pairs)])
        ctx.n_extra += 2 * (2 - len(pairs))  # an empty bias pair takes no gradient
        ctx.mark_non_differentiable(accept, argmax)
        return loss, accept, argmax

    @staticmethod
    def backward(ctx, go, _accept, _argmax):
        return _chunked_backward(ctx, go)


# ----------------------------------------------------------------------------- public ops


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"loss impl {impl!r}: use one of {', '.join(IMPLS)}")


def _use_liger(t: torch.Tensor, impl: str) -> bool:
    _check_impl(impl)
    return impl == "liger" or (impl == "auto" and t.is_cuda)


def linear_cross_entropy(h, w, labels, chunk_size: int = DEFAULT_CHUNK, impl: str = "auto", row_weights=None):
    """Mean CE of ``h @ w.T`` vs ``labels`` (IGNORE_INDEX skipped). h [N, H], w [V, H], labels [N];
    ``row_weights`` [N] (no gradient) scale each row's term (chunked path: Liger takes none)."""
    assert h.dim() == 2 and w.dim() == 2 and labels.shape == h.shape[:1], (h.shape, w.shape, labels.shape)
    if row_weights is None and _use_liger(h, impl):
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        return LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX)(w, h, labels)
    if not _needs_grad(h, w):
        ce, denom = _ce_chunks(labels, row_weights, impl)
        return _chunked_loss_only([(h, w)], chunk_size, denom, ce)
    return _ChunkedLinearCE.apply(h, w, labels, row_weights, chunk_size, impl)


@torch.no_grad()
def linear_token_nll(h, w, labels, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """Per-row -log softmax(h @ w.T)[label], chunked. h [N, H], w [V, H], labels [N] -> [N] float32."""
    out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    for s in range(0, h.shape[0], chunk_size):
        logits = (h[s : s + chunk_size] @ w.T).float()
        out[s : s + chunk_size] = torch.logsumexp(logits, -1) - logits.gather(1, labels[s : s + chunk_size, None])[:, 0]
    return out


def linear_kl(hs, ws, ht, wt, chunk_size: int = DEFAULT_CHUNK, impl: str = "auto", return_argmax: bool = False):
    """Mean over rows of KL(softmax(ht @ wt.T) || softmax(hs @ ws.T)); the teacher gets no gradient.
    ``return_argmax``: also the student's top token per row [N] (read from the logits the chunked loss
    computes anyway; a separate pass after Liger's)."""
    assert hs.shape[0] == ht.shape[0] and ws.shape[0] == wt.shape[0], (hs.shape, ws.shape, ht.shape, wt.shape)
    ht, wt = ht.detach(), wt.detach()
    if _use_liger(hs, impl):
        from liger_kernel.transformers import LigerFusedLinearJSD

        loss = LigerFusedLinearJSD(jsd_beta=0.0)(hs, ws, ht, wt, None)
        return (loss, linear_argmax(hs.detach(), ws.detach(), chunk_size)) if return_argmax else loss
    return _chunked_kl(hs, ws, _linear_teacher(ht, wt), chunk_size, return_argmax, impl)


def linear_kl_to(hs, ws, log_p, rows, chunk_size: int = DEFAULT_CHUNK, return_argmax: bool = False,
                 impl: str = "chunked"):
    """:func:`linear_kl` against teacher log-probs computed once (:func:`teacher_log_probs`): row i's are
    ``log_p[rows[i]]`` (log_p [M, V] float32, rows [N]). For several losses over the same teacher rows, such
    as EAGLE-3's training-time-test steps. The chunked path (Liger takes the teacher's inputs): ``impl``
    ``compiled`` compiles its per-chunk arithmetic, any other name runs it eagerly."""
    assert hs.shape[0] == rows.shape[0] and ws.shape[0] == log_p.shape[1], (hs.shape, ws.shape, log_p.shape, rows.shape)
    _check_impl(impl)
    return _chunked_kl(hs, ws, _table_teacher(log_p, rows), chunk_size, return_argmax, impl)


@torch.no_grad()
def teacher_log_probs(ht, wt, chunk_size: int = DEFAULT_CHUNK) -> torch.Tensor:
    """log softmax(ht @ wt.T) in float32, chunked. ht [N, Ht], wt [V, Ht] -> [N, V]."""
    out = torch.empty(ht.shape[0], wt.shape[0], dtype=torch.float32, device=ht.device)
    teacher = _linear_teacher(ht, wt)
    for s in range(0, ht.shape[0], chunk_size):
        out[s : s + chunk_size] = teacher(s, chunk_size)
    return out


def _chunked_kl(hs, ws, teacher, chunk_size: int, return_argmax: bool, impl: str):
    argmax = torch.empty(hs.shape[0], dtype=torch.int64, device=hs.device) if return_argmax else None
    if not _needs_grad(hs, ws):
        loss = _chunked_loss_only([(hs, ws)], chunk_size, max(hs.shape[0], 1), _kl_chunks(teacher, argmax, impl))
    else:
        loss = _ChunkedLinearKL.apply(hs, ws, teacher, chunk_size, argmax, impl)
    return (loss, argmax) if return_argmax else loss


def linear_block_distill(hs, ws, ht, wt, labels, ce_weight: float = 0.1, tv_weight: float = 0.9,
                         kl_weight: float = 0.0, chunk_size: int = DEFAULT_CHUNK, bias_in=None, bias_w=None,
                         impl: str = "chunked"):
    """Mean over rows of ce_weight * CE(q, labels) + tv_weight * TV(p, q) + kl_weight * KL(p || q), with
    q = softmax(hs @ ws.T [+ bias_in @ bias_w.T]) the student (an optional low-rank bias: bias_in [N, r],
    bias_w [V, r]) and p = softmax(ht @ wt.T) the teacher (no gradient); labels [N] (IGNORE_INDEX: no CE
    term). Returns (loss, accept [N] = sum_x min(p, q), student argmax [N]).

    The chunked torch path on every device (Liger has no total-variation loss): ``impl`` ``compiled``
    compiles its per-chunk arithmetic, any other name runs it eagerly."""
    assert hs.shape[0] == ht.shape[0] == labels.shape[0] and ws.shape[0] == wt.shape[0], (
        hs.shape, ws.shape, ht.shape, wt.shape, labels.shape)
    ht, wt = ht.detach(), wt.detach()
    weights = (float(ce_weight), float(tv_weight), float(kl_weight))
    if bias_in is None:
        bias_in, bias_w = hs.new_zeros(0), ws.new_zeros(0)
    if _needs_grad(hs, ws, bias_in, bias_w):
        return _ChunkedLinearBlock.apply(hs, ws, bias_in, bias_w, ht, wt, labels, weights, chunk_size, impl)
    accept = torch.empty(hs.shape[0], dtype=torch.float32, device=hs.device)
    argmax = torch.empty(hs.shape[0], dtype=torch.int64, device=hs.device)
    pairs = [(hs, ws), (bias_in, bias_w)] if bias_in.numel() else [(hs, ws)]
    loss = _chunked_loss_only(pairs, chunk_size, max(hs.shape[0], 1),
                              _block_chunks(ht, wt, labels, *weights, accept, argmax, impl))
    return loss, accept, argmax


def plain_linear_block_distill(hs, ws, ht, wt, labels, ce_weight=0.1, tv_weight=0.9, kl_weight=0.0):
    """Reference: materialises both logit matrices."""
    log_q = torch.log_softmax((hs @ ws.T).float(), -1)
    log_p = torch.log_softmax((ht @ wt.T).float(), -1).detach()
    p, q = log_p.exp(), log_q.exp()
    valid = labels != IGNORE_INDEX
    ce = -(log_q.gather(1, labels.clamp(min=0)[:, None])[:, 0] * valid).sum()
    tv = 0.5 * (q - p).abs().sum(-1)
    kl = (p * (log_p - log_q)).sum()
    n = max(hs.shape[0], 1)
    return (ce_weight * ce + tv_weight * tv.sum() + kl_weight * kl) / n, 1 - tv.detach(), log_q.argmax(-1)


def plain_linear_cross_entropy(h, w, labels):
    """Reference: materialises the logits."""
    return F.cross_entropy((h @ w.T).float(), labels, ignore_index=IGNORE_INDEX)


def plain_linear_kl(hs, ws, ht, wt):
    """Reference: materialises both logit matrices."""
    log_q = torch.log_softmax((hs @ ws.T).float(), -1)
    log_p = torch.log_softmax((ht @ wt.T).float(), -1).detach()
    return (log_p.exp() * (log_p - log_q)).sum(-1).mean()


# ----------------------------------------------------------------------------- family losses


def medusa_loss(
    feats: torch.Tensor,  # [K, B, T, H] head outputs before projection
    projections,  # list of K weights [V', H]
    labels: torch.Tensor,  # [B, T] label of the token at each position (head vocab index, IGNORE_INDEX if none)
    loss_mask: torch.Tensor,  # [B, T]
    doc_ids: torch.Tensor,  # [B, T]
    decay: float = 0.8,
    **kw,
):
    """Σ_k decay^k · CE(head_k(h_t), x_{t+1+k}), k = 1..K; returns (total, per-head losses, per-head top-1).

    Head k (1-based) at position t is scored on the label at t + 1 + k. Positions whose label is
    IGNORE_INDEX (e.g. outside a draft vocabulary) are left out of the loss and count as misses.
    """
    total = feats.new_zeros((), dtype=torch.float32)
    losses, accs = [], []
    for i in range(feats.shape[0]):
        k = i + 1
        m = future_mask(loss_mask, doc_ids, 1 + k)
        tgt = shift_left(labels, 1 + k, fill=IGNORE_INDEX)[m]
        h = feats[i][m]
        if not (tgt != IGNORE_INDEX).any():
            losses.append(total.new_zeros(()))
            accs.append(float("nan"))
            total = total + feats[i].sum() * 0.0 + projections[i].sum() * 0.0  # every parameter in the graph (DDP)
            continue
        loss = linear_cross_entropy(h, projections[i], tgt, **kw)
        total = total + (decay**k) * loss
        losses.append(loss.detach())
        accs.append((linear_argmax(h.detach(), projections[i].detach()) == tgt).float().mean().item())
    return total, losses, accs


def eagle_loss(
    pred: torch.Tensor,  # [B, T, H] f̂_{t+1} predicted at position t
    features: torch.Tensor,  # [B, T, H] target last hidden state f (post-norm)
    mask: torch.Tensor,  # [B, T] bool: future_mask(..., d=2)
    student_w: torch.Tensor,  # [V', H] draft projection
    teacher_w: torch.Tensor,  # [V', H] target lm_head rows over the same vocabulary
    target_argmax: torch.Tensor,  # [B, T] target's predicted token id index space of student_w, -1 outside
    feature_weight: float = 1.0,
    kl_weight: float = 0.1,
    **kw,
):
    """EAGLE-1: feature_weight·SmoothL1(f̂_{t+1}, f_{t+1}) + kl_weight·KL(p_target(f_{t+1}) || q(f̂_{t+1}))."""
    nxt = shift_left(features, 1)
    p, f = pred[mask], nxt[mask].detach()
    if p.shape[0] == 0:
        z = pred.sum() * 0.0 + student_w.sum() * 0.0
        return z, {"reg": z.detach(), "kl": z.detach(), "acc": float("nan")}
    reg = F.smooth_l1_loss(p.float(), f.float(), reduction="none").mean(-1).mean()
    kl, got = linear_kl(p, student_w, f, teacher_w, return_argmax=True, **kw)
    want = shift_left(target_argmax, 1, fill=-1)[mask]
    acc = (got == want).float().mean().item()
    return feature_weight * reg + kl_weight * kl, {"reg": reg.detach(), "kl": kl.detach(), "acc": acc}


# the most memory the teacher's log-probs over the draft vocabulary may take to be computed once for every
# TTT step (float32 [scored positions, draft vocab]); past it each step computes its own
TEACHER_CACHE_BYTES = 1 << 30


def ttt_targets(loss_mask: torch.Tensor, doc_ids: torch.Tensor, target_argmax_draft: torch.Tensor, steps: int):
    """Per training-time-test step j, [B, T] each: the positions whose token t + 2 + j is an answer token
    of the same document, the draft index of the target's argmax there (-1 outside the draft
    vocabulary), and the positions the loss scores (both)."""
    masks = [future_mask(loss_mask, doc_ids, 2 + j) for j in range(steps)]
    wants = [shift_left(target_argmax_draft, 1 + j, fill=-1) for j in range(steps)]
    return masks, wants, [m & (want >= 0) for m, want in zip(masks, wants)]


def ttt_scored_positions(loss_mask: torch.Tensor, doc_ids: torch.Tensor, target_argmax_draft: torch.Tensor,
                         steps: int) -> torch.Tensor:
    """[B, T] bool: the positions the loss of some training-time-test step scores (``Eagle3Head.ttt``'s
    ``keep``)."""
    return torch.stack(ttt_targets(loss_mask, doc_ids, target_argmax_draft, steps)[2]).any(0)


def eagle3_loss(
    step_outs,  # list of J normed draft outputs [B, T, H]
    features: torch.Tensor,  # [B, T, H_target] target last hidden state (post-norm)
    loss_mask: torch.Tensor,  # [B, T]
    doc_ids: torch.Tensor,  # [B, T]
    student_w: torch.Tensor,  # [Vd, H] draft lm_head
    teacher_w: torch.Tensor,  # [Vd, H_target] target lm_head rows of the draft vocab
    target_argmax_draft: torch.Tensor,  # [B, T] draft index of the target's argmax at t, -1 outside the draft vocab
    decay: float = 0.8,
    **kw,
):
    """Σ_j decay^j · KL(p_target restricted to the draft vocab || q_draft), step j at t vs position t+1+j.

    Positions whose target argmax lies outside the draft vocabulary are masked out of the loss (they
    count as misses in the accuracies). The steps score mostly the same target positions, so on the
    chunked path the teacher's log-probs are computed once for all of them.
    """
    total = features.new_zeros((), dtype=torch.float32)
    losses, accs = [], []
    masks, wants, scored = ttt_targets(loss_mask, doc_ids, target_argmax_draft, len(step_outs))
    chunk = kw.get("chunk_size", DEFAULT_CHUNK)
    slot = _teacher_slots(scored, teacher_w.shape[0]) if not _use_liger(features, kw.get("impl", "auto")) else None
    if slot is not None:  # [B, T]: the row of the teacher's log-probs table each position reads, -1 if none
        table = teacher_log_probs(features[slot >= 0].detach(), teacher_w.detach(), chunk)
    for j, (out, m, want, in_vocab) in enumerate(zip(step_outs, masks, wants, scored)):
        if not in_vocab.any():
            accs.append(0.0 if m.any() else float("nan"))
            losses.append(total.new_zeros(()))
            total = total + out.sum() * 0.0 + student_w.sum() * 0.0  # keep every parameter in the graph (DDP)
            continue
        if slot is None:
            kl, got = linear_kl(out[in_vocab], student_w, shift_left(features, 1 + j)[in_vocab], teacher_w,
                                return_argmax=True, **kw)
        else:
            kl, got = linear_kl_to(out[in_vocab], student_w, table, shift_left(slot, 1 + j, fill=-1)[in_vocab],
                                   chunk_size=chunk, return_argmax=True, impl=kw.get("impl", "chunked"))
        # a target token outside the draft vocabulary is a miss: hits over every scored position
        accs.append(((got == want[in_vocab]).sum() / m.sum()).item())
        total = total + (decay**j) * kl
        losses.append(kl.detach())
    return total, losses, accs


def _teacher_slots(scored, vocab: int) -> torch.Tensor | None:
    """[B, T] long: for each target position some step scores (step j at t scores t + 1 + j), its row in
    a table of the teacher's log-probs, else -1; None when that table would pass TEACHER_CACHE_BYTES."""
    need = torch.zeros_like(scored[0])
    for j, m in enumerate(scored):
        if 1 + j < m.shape[1]:
            need[:, 1 + j :] |= m[:, : m.shape[1] - 1 - j]
    count = int(need.sum())
    if count * vocab * 4 > TEACHER_CACHE_BYTES:
        return None
    slot = torch.full(need.shape, -1, dtype=torch.long, device=need.device)
    slot[need] = torch.arange(count, device=need.device)
    return slot
