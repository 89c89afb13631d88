"""Per-token log-probs and entropies of sampled tokens, from the logits, a chunk of positions at a time.

The straightforward computation (`logits.float()`, the temperature copy, `log_softmax`,
`exp`, their product) holds four to five `[rows, positions, vocab]` fp32 tensors at once,
and autograd keeps some for backward: about 10 GiB each for one micro-batch of the ExGRPO
preset (18,432 tokens x 152,064 entries). Here the logits (in the compute dtype, as the
model returns them) are the only full-size tensor, with their gradient in backward: a
custom autograd function works through `chunk_tokens` tokens at a time in fp32, from
`logsumexp`, in forward and again in backward (recomputing the chunk's softmax rather than
keeping it), writing the gradient into one preallocated tensor.

With s = logits / T, lse = logsumexp(s), p = softmax(s):
    log p(t) = s_t - lse                      d/ds_v = [v = t] - p_v
    H = lse - sum_v p_v s_v                   d/ds_v = -p_v (log p_v + H)
and d/dlogits = d/ds / T. Values and gradients equal the full computation (the tests check
both against `log_softmax` and with `gradcheck`).
"""

from __future__ import annotations

import torch


class _TokenStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature: float, positions: int, entropy: bool, entropy_grad: bool):
        rows, length, _ = logits.shape
        dtype = _working_dtype(logits)
        logp = torch.empty(rows, length, dtype=dtype, device=logits.device)
        ent = torch.empty(rows, length, dtype=dtype, device=logits.device) if entropy else None
        for start in range(0, length, positions):
            end = min(start + positions, length)
            scaled, lse = _scaled(logits[:, start:end], temperature)
            logp[:, start:end] = scaled.gather(-1, targets[:, start:end, None]).squeeze(-1) - lse
            if entropy:
                probs = torch.exp(scaled - lse[..., None])
                ent[:, start:end] = lse - torch.linalg.vecdot(probs, scaled)
                del probs
            del scaled
        ctx.save_for_backward(logits, targets)
        ctx.temperature, ctx.positions, ctx.entropy_grad = temperature, positions, entropy and entropy_grad
        if ent is None:
            ent = logp.new_zeros(0)
            ctx.mark_non_differentiable(ent)
        elif not entropy_grad:
            ctx.mark_non_differentiable(ent)
        if ctx.entropy_grad:
            ctx.entropy = ent.detach()
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, targets = ctx.saved_tensors
        grad = torch.empty_like(logits)
        length = logits.shape[1]
        for start in range(0, length, ctx.positions):
            end = min(start + ctx.positions, length)
            scaled, lse = _scaled(logits[:, start:end], ctx.temperature)
            log_probs = scaled.sub_(lse[..., None])  # in place: the chunk's scaled logits are done with
            probs = torch.exp(log_probs)
            g_logp = grad_logp[:, start:end, None].to(scaled.dtype)
            chunk = probs.mul(-g_logp)
            chunk.scatter_add_(-1, targets[:, start:end, None], g_logp)
            if ctx.entropy_grad and grad_ent is not None:
                entropy = ctx.entropy[:, start:end, None]
                chunk.sub_(probs.mul_(log_probs.add_(entropy)).mul_(grad_ent[:, start:end, None].to(scaled.dtype)))
            grad[:, start:end] = chunk.div_(ctx.temperature).to(grad.dtype)
            del scaled, probs, chunk
        return grad, None, None, None, None, None


def _working_dtype(logits: torch.Tensor) -> torch.dtype:
    """fp32 for bf16 / fp16 logits (or fp64 ones, kept)."""
    return torch.promote_types(logits.dtype, torch.float32)


def _scaled(piece: torch.Tensor, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunk's logits / T in the working dtype (a new tensor), and their logsumexp."""
    scaled = piece.to(_working_dtype(piece), copy=True).div_(temperature)
    return scaled, torch.logsumexp(scaled, dim=-1)


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, temperature: float, entropy: str = "none",
                   chunk_tokens: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """([n, W] log-prob of each token given the ones before it, [n, W] entropy of the
    distribution it was drawn from, or None), both 0 at position 0, from the model's
    `logits` ([n, W, V], any dtype) at sampling temperature `temperature`.

    `entropy`: "none", "detached" (a metric: no gradient flows through it) or "grad".
    `chunk_tokens`: tokens of each fp32 chunk (at least one position of every row).
    """
    rows, width, _ = logits.shape
    # Position j predicts token j + 1; the last position predicts nothing (its target is a
    # placeholder and its outputs are dropped): no slice of the logits, whose backward would
    # allocate another full-size gradient.
    targets = torch.zeros_like(input_ids)
    targets[:, :-1] = input_ids[:, 1:]
    positions = max(1, chunk_tokens // max(1, rows))
    wants = entropy != "none"
    logp, ent = _TokenStats.apply(logits, targets, float(temperature), positions, wants, entropy == "grad")
    shift = torch.nn.functional.pad
    return shift(logp[:, :-1], (1, 0)), (shift(ent[:, :-1], (1, 0)) if wants else None)
