"""Chunked log-probs and entropies (rayrep/learner/logprobs.py) against the full computation."""

from __future__ import annotations

import pytest
import torch

from rayrep.learner.logprobs import token_logprobs


def full(logits: torch.Tensor, ids: torch.Tensor, temperature: float):
    """The straightforward computation: log_softmax over the whole [n, W - 1, V] tensor."""
    log_probs = torch.log_softmax(logits[:, :-1].to(torch.promote_types(logits.dtype, torch.float32)) / temperature, -1)
    logp = torch.zeros(ids.shape, dtype=log_probs.dtype)
    logp[:, 1:] = log_probs.gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = torch.zeros(ids.shape, dtype=log_probs.dtype)
    entropy[:, 1:] = -(log_probs.exp() * log_probs).sum(-1)
    return logp, entropy


def batch(dtype, rows=3, width=9, vocab=17, seed=0):
    generator = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, width, vocab, generator=generator)).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (rows, width), generator=generator)
    return logits, ids


@pytest.mark.parametrize("chunk_tokens", [1, 7, 12, 10_000])  # a position at a time, chunks that do not divide, one chunk
def test_values_and_gradients_equal_the_full_computation(chunk_tokens):
    logits, ids = batch(torch.float32)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1))
    logp, entropy = token_logprobs(logits, ids, 0.7, "grad", chunk_tokens)
    ref_logp, ref_entropy = full(logits, ids, 0.7)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-4)  # fp32 round-off of either sum
    # A loss of both, as the policy loss with an entropy coefficient takes them.
    (grad,) = torch.autograd.grad((logp * weights).sum() - 0.3 * (entropy * weights).sum(), logits)
    (ref_grad,) = torch.autograd.grad((ref_logp * weights).sum() - 0.3 * (ref_entropy * weights).sum(), logits)
    # fp32 round-off of the entropy term's sums depends on the CPU's kernels: one element in
    # 459 differed by 1.2e-6 on an AMD EPYC (a wrong gradient is off by orders more).
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=5e-6)


@pytest.mark.parametrize("entropy", ["grad", "detached", "none"])
def test_gradcheck_in_double_precision(entropy):
    logits, ids = batch(torch.float64, rows=2, width=5, vocab=7)

    def outputs(x):
        logp, ent = token_logprobs(x, ids, 1.3, entropy, chunk_tokens=4)
        return (logp, ent) if entropy == "grad" else logp

    assert torch.autograd.gradcheck(outputs, (logits,))


def test_a_detached_entropy_is_a_metric_only():
    logits, ids = batch(torch.float32)
    logp, entropy = token_logprobs(logits, ids, 1.0, "detached", chunk_tokens=5)
    assert logp.requires_grad and not entropy.requires_grad
    torch.testing.assert_close(entropy, full(logits, ids, 1.0)[1], rtol=1e-5, atol=1e-5)
    assert token_logprobs(logits, ids, 1.0, "none")[1] is None


def test_bf16_logits_work_in_fp32_and_keep_their_gradient_in_bf16():
    logits, ids = batch(torch.bfloat16, rows=4, width=16, vocab=64)
    logp, entropy = token_logprobs(logits, ids, 0.6, "grad", chunk_tokens=8)
    assert logp.dtype == entropy.dtype == torch.float32
    ref_logp, ref_entropy = full(logits, ids, 0.6)  # the same bf16 logits, upcast whole
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    (grad,) = torch.autograd.grad(logp.sum() + entropy.sum(), logits)
    (ref_grad,) = torch.autograd.grad(ref_logp.sum() + ref_entropy.sum(), logits)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), ref_grad.float(), rtol=2e-2, atol=2e-3)  # bf16 rounding of the result
