"""The objectives beside PPO (GSPO, CISPO, SAPO) and the KL penalty to a reference policy,
against a transcription of verl's own code (verl 0.9.0, `verl/trainer/ppo/core_algos.py`:
`compute_policy_loss_gspo`, `compute_policy_loss_cispo`, `compute_policy_loss_sapo`,
`kl_penalty`, `agg_loss`), on a hand-made batch: rows of unequal length, ratios far outside
the clips on both sides, advantages of both signs, padding that holds garbage on our side."""

from __future__ import annotations

import math

import pytest
import torch

from rayrep.errors import ConfigError
from rayrep.learner.loss import kl_penalty, mini_batch_totals, policy_loss
from rayrep.types import KL_ESTIMATORS, LossSpec, SpecError

# ---------------------------------------------------------------- verl, transcribed


def verl_masked_sum(values, mask, axis=None):
    valid = torch.where(mask.bool(), values, 0.0) * mask
    return valid.sum() if axis is None else valid.sum(axis)


def verl_masked_mean(values, mask, axis=None):
    return verl_masked_sum(values, mask, axis) / (mask.sum(axis) + 1e-8 if axis is not None else mask.sum() + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, loss_agg_mode):
    """`agg_loss` of one data-parallel rank whose batch is the whole mini-batch."""
    if loss_agg_mode == "token-mean":
        return verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    seq_mask = (loss_mask.sum(-1) > 0).float()
    if loss_agg_mode == "seq-mean-token-mean":
        seq_losses = (loss_mat * loss_mask).sum(-1) / (loss_mask.sum(-1) + 1e-8)
    else:
        seq_losses = (loss_mat * loss_mask).sum(-1)
    return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()


def verl_gspo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high):
    negative_approx_kl = log_prob - old_log_prob
    seq_lengths = torch.sum(response_mask, dim=-1).clamp(min=1)
    negative_approx_kl_seq = torch.sum(negative_approx_kl * response_mask, dim=-1) / seq_lengths
    log_seq_importance_ratio = log_prob - log_prob.detach() + negative_approx_kl_seq.detach().unsqueeze(-1)
    log_seq_importance_ratio = torch.clamp(log_seq_importance_ratio, max=10.0)
    seq_importance_ratio = torch.exp(log_seq_importance_ratio)
    pg_losses1 = -advantages * seq_importance_ratio
    pg_losses2 = -advantages * torch.clamp(seq_importance_ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    return verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")


def verl_cispo(old_log_prob, log_prob, advantages, response_mask, clip_ratio_low, clip_ratio_high, loss_agg_mode):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    clipped_ratio_sg = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high).detach()
    pg_losses = -clipped_ratio_sg * advantages * log_prob
    return verl_agg_loss(pg_losses, response_mask, loss_agg_mode)


def verl_sapo(old_log_prob, log_prob, advantages, response_mask, tau_pos, tau_neg):
    def gate_function(x, tau):
        return torch.sigmoid(tau * (x - 1.0)) * (4.0 / tau)

    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    taus = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=advantages.dtype),
                       torch.as_tensor(tau_neg, dtype=advantages.dtype))
    pg_losses = -gate_function(ratio, taus) * advantages
    return verl_agg_loss(pg_losses, response_mask, "seq-mean-token-mean")


def verl_kl_penalty(logprob, ref_logprob, kl_penalty_name):
    def forward(logprob, ref_logprob, name):
        if name in ("kl", "k1"):
            return logprob - ref_logprob
        if name == "abs":
            return (logprob - ref_logprob).abs()
        if name in ("mse", "k2"):
            return 0.5 * (logprob - ref_logprob).square()
        if name in ("low_var_kl", "k3"):
            kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
            kld = torch.exp(kl) - kl - 1
            return torch.clamp(kld, min=-10, max=10)
        raise NotImplementedError(name)

    base = kl_penalty_name[:-1] if kl_penalty_name.endswith("+") else kl_penalty_name
    forward_score = forward(logprob, ref_logprob, base)
    if not kl_penalty_name.endswith("+") or kl_penalty_name in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


# ---------------------------------------------------------------- the batch

LENGTHS = [5, 2, 4, 1]
ADVANTAGES = [1.5, -0.7, -2.0, 0.9]
# Per-token log ratios far outside every clip: e^2.5 = 12, e^-3 = 0.05; row 0's mean 1.2 is outside
# GSPO's tight band as well as PPO's, row 2's mean is -1.45.
LOG_RATIOS = [[2.5, -1.0, 0.4, 3.0, 1.1], [-3.0, 0.05], [-0.3, -4.0, 0.2, -1.7], [0.0001]]


def batch(garbage: bool):
    """(logp, old_logp, advantages [B], per-token advantages [B, T], mask); `garbage`: padding
    holds -inf and huge values (ours must not see them); else zeros (verl's transcription
    multiplies masked values by 0, which a -inf would turn into NaN)."""
    width = max(LENGTHS)
    mask = torch.zeros(len(LENGTHS), width, dtype=torch.bool)
    old = torch.full((len(LENGTHS), width), -math.inf if garbage else 0.0, dtype=torch.float64)
    new = torch.full((len(LENGTHS), width), 1e30 if garbage else 0.0, dtype=torch.float64)
    generator = torch.Generator().manual_seed(5)
    for row, (length, ratios) in enumerate(zip(LENGTHS, LOG_RATIOS)):
        mask[row, :length] = True
        old[row, :length] = -torch.rand(length, generator=generator, dtype=torch.float64) * 3 - 0.1
        new[row, :length] = old[row, :length] + torch.tensor(ratios, dtype=torch.float64)
    advantages = torch.tensor(ADVANTAGES, dtype=torch.float64)
    return new.requires_grad_(), old, advantages, advantages[:, None].expand_as(new).clone(), mask


def ours(spec: LossSpec, ref_logp=None):
    logp, old, advantages, _, mask = batch(garbage=True)
    loss, metrics = policy_loss(logp, old, advantages, mask, spec, ref_logp=ref_logp)
    loss.backward()
    return loss.item(), torch.where(mask, logp.grad, 0.0), metrics


def verls(function, **kwargs):
    logp, old, _, token_advantages, mask = batch(garbage=False)
    loss = function(old, logp, token_advantages, mask.double(), **kwargs)
    loss.backward()
    return loss.item(), torch.where(mask, logp.grad, 0.0)


def assert_same(ours_result, verl_result):
    (value, grad, _), (verl_value, verl_grad) = ours_result, verl_result
    # verl divides by (count + 1e-8): a relative difference of about 1e-8.
    assert value == pytest.approx(verl_value, rel=1e-7, abs=1e-12)
    assert torch.allclose(grad, verl_grad, rtol=1e-7, atol=1e-12)
    assert grad.abs().sum() > 0


# ---------------------------------------------------------------- the objectives


@pytest.mark.parametrize(("low", "high"), [(3e-4, 4e-4), (0.2, 0.28)])
def test_gspo_equals_verls(low, high):
    spec = LossSpec(objective="gspo", clip_low=low, clip_high=high, dual_clip=None, agg="seq-mean-token-mean")
    assert_same(ours(spec), verls(verl_gspo, clip_ratio_low=low, clip_ratio_high=high))


def test_gspo_clips_an_answers_tokens_together_and_caps_its_log_ratio():
    spec = LossSpec(objective="gspo", clip_low=0.2, clip_high=0.28, dual_clip=None, agg="seq-mean-token-mean")
    _, grad, metrics = ours(spec)
    # Row 0 (A > 0, mean log ratio 1.2) and row 2 (A < 0, mean -1.45) are clipped whole; row 1
    # (A < 0, mean -1.475) is below the band with a negative advantage: clipped; row 3 (ratio
    # about 1, one token) is inside: its gradient is -A s over the 4 answers' mean.
    assert (grad[0] == 0).all() and (grad[1] == 0).all() and (grad[2] == 0).all()
    assert grad[3, 0].item() == pytest.approx(-0.9 * math.exp(0.0001) / 4, rel=1e-12)
    assert metrics["fresh_clip_frac"] == pytest.approx(11 / 12)
    # A sequence log ratio above 10 is capped: value e^10, no gradient, whatever the advantage.
    logp = torch.tensor([[12.0, 11.0]], dtype=torch.float64, requires_grad=True)
    loss, _ = policy_loss(logp, torch.zeros(1, 2, dtype=torch.float64), torch.tensor([-1.0], dtype=torch.float64),
                          torch.ones(1, 2, dtype=torch.bool), LossSpec(objective="gspo", dual_clip=None, clip_fresh=False))
    loss.backward()
    assert loss.item() == pytest.approx(math.exp(10.0)) and (logp.grad == 0).all()


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.28), (0.999, 0.2)])
def test_cispo_equals_verls(agg, low, high):
    spec = LossSpec(objective="cispo", clip_low=low, clip_high=high, dual_clip=None, agg=agg)
    assert_same(ours(spec), verls(verl_cispo, clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=agg))


def test_cispo_keeps_every_tokens_gradient():
    spec = LossSpec(objective="cispo", dual_clip=None, agg="token-mean")
    _, grad, metrics = ours(spec)
    logp, _, _, token_advantages, mask = batch(garbage=False)
    # d/d logp of -sg(w) A logp: -w A, w the ratio clipped to [0.8, 1.28]; never 0.
    ratio = torch.tensor([r + [0.0] * (max(LENGTHS) - len(r)) for r in LOG_RATIOS], dtype=torch.float64).exp()
    expected = -ratio.clamp(0.8, 1.28) * token_advantages / mask.sum()
    assert torch.allclose(grad, torch.where(mask, expected, 0.0), rtol=1e-12)
    assert (grad[mask] != 0).all()
    clipped = ((ratio < 0.8) | (ratio > 1.28)) & mask
    assert metrics["fresh_clip_frac"] == pytest.approx(float(clipped.sum()) / float(mask.sum()))


@pytest.mark.parametrize(("tau_pos", "tau_neg"), [(1.0, 1.05), (0.5, 3.0)])
def test_sapo_equals_verls(tau_pos, tau_neg):
    spec = LossSpec(objective="sapo", dual_clip=None, agg="seq-mean-token-mean", sapo_tau_pos=tau_pos,
                    sapo_tau_neg=tau_neg)
    assert_same(ours(spec), verls(verl_sapo, tau_pos=tau_pos, tau_neg=tau_neg))


def test_sapos_gate_has_ppos_slope_at_ratio_one_and_fades_away_from_it():
    def gradient(ratio: float, advantage: float) -> float:
        logp = torch.tensor([[math.log(ratio)]], dtype=torch.float64, requires_grad=True)
        loss, _ = policy_loss(logp, torch.zeros(1, 1, dtype=torch.float64), torch.tensor([advantage], dtype=torch.float64),
                              torch.ones(1, 1, dtype=torch.bool), LossSpec(objective="sapo", dual_clip=None))
        loss.backward()
        return logp.grad.item()

    assert gradient(1.0, 2.0) == pytest.approx(-2.0)  # d/dlogp of -A r at r = 1
    assert gradient(1.0, -2.0) == pytest.approx(2.0)
    assert 0 < -gradient(20.0, 1.0) < 1e-5 and 0 < gradient(0.01, -1.0) < 0.05


@pytest.mark.parametrize("objective", ["gspo", "cispo", "sapo"])
def test_objectives_act_where_ppo_does_and_shaped_replay_stays_shaped(objective):
    """Replayed rows under ExGRPO's shaping keep it whatever the objective; the other rows
    train with the objective (here: the same loss as a batch of those rows alone)."""
    logp, old, advantages, _, mask = batch(garbage=True)
    replay = torch.tensor([False, True, False, True])
    spec = LossSpec(objective=objective, dual_clip=None, agg="token-mean", replay_loss="shaped")
    loss, metrics = policy_loss(logp, old, advantages, mask, spec, replay_mask=replay)
    fresh_rows, replay_rows = [0, 2], [1, 3]
    alone, _ = policy_loss(logp[fresh_rows], old[fresh_rows], advantages[fresh_rows], mask[fresh_rows],
                           LossSpec(objective=objective, dual_clip=None, agg="token-mean"))
    shaped, _ = policy_loss(logp[replay_rows], old[replay_rows], advantages[replay_rows], mask[replay_rows], spec,
                            replay_mask=torch.tensor([True, True]))
    fresh_tokens, replay_tokens = float(mask[fresh_rows].sum()), float(mask[replay_rows].sum())
    expected = (alone * fresh_tokens + shaped * replay_tokens) / (fresh_tokens + replay_tokens)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-12)


@pytest.mark.parametrize("objective", ["ppo", "gspo", "cispo", "sapo"])
def test_micro_batches_sum_to_the_mini_batch_for_every_objective(objective):
    logp, old, advantages, _, mask = batch(garbage=True)
    spec = LossSpec(objective=objective, dual_clip=None, agg="seq-mean-token-mean", kl_coef=0.1)
    ref = old - 0.3
    whole, _ = policy_loss(logp, old, advantages, mask, spec, ref_logp=ref)
    (whole_grad,) = torch.autograd.grad(whole, logp)
    totals = mini_batch_totals(mask, spec.agg)
    parts = [policy_loss(logp[rows], old[rows], advantages[rows], mask[rows], spec, totals=totals, ref_logp=ref[rows])[0]
             for rows in ([0, 3], [1], [2])]
    (parts_grad,) = torch.autograd.grad(sum(parts), logp)
    assert sum(parts).item() == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(torch.where(mask, parts_grad, 0.0), torch.where(mask, whole_grad, 0.0), rtol=1e-10)


# ---------------------------------------------------------------- the KL penalty


@pytest.mark.parametrize("estimator", KL_ESTIMATORS)
def test_kl_penalty_equals_verls_value_and_gradient(estimator):
    generator = torch.Generator().manual_seed(3)
    logp = (-torch.rand(3, 6, generator=generator, dtype=torch.float64) * 4).requires_grad_()
    # Differences of every size: small, large (k3 clamps at 10), beyond k3's exponent clamp of 20.
    ref = logp.detach() + torch.tensor([0.01, -0.5, 2.0, -3.0, 25.0, -30.0], dtype=torch.float64)
    (grad,) = torch.autograd.grad(kl_penalty(logp, ref, estimator, dtype=torch.float64).sum(), logp)
    value = kl_penalty(logp, ref, estimator, dtype=torch.float64)
    verl_logp = logp.detach().clone().requires_grad_()
    verl_value = verl_kl_penalty(verl_logp, ref, estimator)
    (verl_grad,) = torch.autograd.grad(verl_value.sum(), verl_logp)
    assert torch.allclose(value, verl_value, rtol=1e-12)
    assert torch.allclose(grad, verl_grad, rtol=1e-12)


@pytest.mark.parametrize("objective", ["ppo", "cispo"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("estimator", ["k1", "abs", "k2", "k3", "k3+"])
def test_the_kl_loss_term_is_verls(objective, agg, estimator):
    """verl's actor loss with `use_kl_loss`: the policy loss plus kl_loss_coef x the KL
    aggregated as the policy loss is (the actor's loss_agg_mode)."""
    coef = 0.05
    logp, old, advantages, _, mask = batch(garbage=True)
    ref = torch.where(mask, old + torch.linspace(-2, 2, old.shape[1], dtype=torch.float64), math.nan)
    spec = LossSpec(objective=objective, dual_clip=None, agg=agg, kl_coef=coef, kl_estimator=estimator)
    loss, metrics = policy_loss(logp, old, advantages, mask, spec, ref_logp=ref)
    (grad,) = torch.autograd.grad(loss, logp)

    clean_logp, clean_old, _, token_advantages, clean_mask = batch(garbage=False)
    clean_ref = torch.where(clean_mask, ref, 0.0)
    if objective == "cispo":
        pg = verl_cispo(clean_old, clean_logp, token_advantages, clean_mask.double(), 0.2, 0.28, agg)
    else:  # verl's vanilla PPO (compute_policy_loss_vanilla) without its dual clip: the clipped ratio
        ratio = torch.exp(torch.clamp(clean_logp - clean_old, -20.0, 20.0))
        pg = verl_agg_loss(torch.maximum(-token_advantages * ratio, -token_advantages * ratio.clamp(0.8, 1.28)),
                           clean_mask.double(), agg)
    kld = verl_kl_penalty(clean_logp, clean_ref, estimator)
    verl_loss = pg + coef * verl_agg_loss(kld, clean_mask.double(), agg)
    (verl_grad,) = torch.autograd.grad(verl_loss, clean_logp)
    # verl divides by (count + 1e-8): its terms of about 1 differ from ours by about 1e-8.
    assert loss.item() == pytest.approx(verl_loss.item(), rel=1e-7, abs=1e-8)
    assert torch.allclose(torch.where(mask, grad, 0.0), torch.where(clean_mask, verl_grad, 0.0), rtol=1e-7, atol=1e-9)
    assert metrics["kl_ref"] == pytest.approx(float(verl_masked_mean(kld, clean_mask.double()).detach()), rel=1e-7)


def test_kl_needs_the_reference_log_probs():
    logp, old, advantages, _, mask = batch(garbage=True)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, old, advantages, mask, LossSpec(kl_coef=0.1))


# ---------------------------------------------------------------- the config


def test_the_config_names_the_objective_and_refuses_what_means_nothing():
    from rayrep.config import parse_cli

    def spec(*overrides):
        return parse_cli([f"--{override}" for override in overrides]).learner.loss_spec()

    assert spec().objective == "ppo" and spec().dual_clip == 10.0
    # The dual clip bounds PPO's ratio: the other objectives leave it off (it is PPO's default).
    gspo = spec("learner.objective=gspo", "learner.clip_low=3e-4", "learner.clip_high=4e-4")
    assert (gspo.objective, gspo.dual_clip, gspo.clip_low) == ("gspo", None, 3e-4)
    kl = spec("learner.kl.coef=0.001", "learner.kl.estimator=low_var_kl")
    assert (kl.kl_coef, kl.kl_estimator) == (0.001, "low_var_kl")
    with pytest.raises(ConfigError, match="learner.objective"):
        spec("learner.objective=grpo")
    with pytest.raises(ConfigError, match="learner.kl.estimator"):
        spec("learner.kl.estimator=k4")
    with pytest.raises(SpecError, match="dual_clip"):
        LossSpec(objective="cispo", dual_clip=3.0)
    # In the reward, the penalty is the algorithm's: the loss has none.
    assert spec("learner.kl.coef=0.01", "learner.kl.in_reward=true").kl_coef == 0
    with pytest.raises(ConfigError, match="learner.kl.in_reward puts the KL penalty in the reward"):
        spec("learner.kl.in_reward=true")


# ---------------------------------------------------------------- the reference policy


def test_with_lora_the_reference_is_the_base_with_the_adapter_switched_off(tiny_cfg, tiny_policy):
    """A LoRA run's reference costs no weights: its pass is the policy's own with PEFT's
    adapter layers switched off, which gives the base policy's log-probs; after it the adapter
    computes and trains again."""
    import random

    from transformers import AutoModelForCausalLM

    from rayrep.learner.reference import FrozenPolicy, Reference
    from rayrep.learner.sharding import with_lora
    from rayrep.models.adapter import lora_config
    from rayrep.types import TrainBatch

    cfg = tiny_cfg.replace(**{"learner.lora_rank": 8, "learner.kl.coef": 0.01})
    adapted = with_lora(AutoModelForCausalLM.from_pretrained(tiny_policy), lora_config(cfg, tiny_policy), torch.float32)
    with torch.no_grad():  # an adapter that has trained: B is no longer 0
        for name, param in adapted.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(6)] for _ in range(2)]
    batch = TrainBatch.of_sequences([p for p in prompts for _ in range(3)],
                                    [[rng.randrange(3, 259) for _ in range(rng.randint(2, 9))] for _ in range(6)],
                                    [0, 0, 0, 1, 1, 1])
    steps = [range(0, 2)]

    def logprobs(model, lora: bool) -> torch.Tensor:
        policy = FrozenPolicy(model=model, module=model, whole_parameters=True)
        return Reference(cfg, policy, torch.device("cpu"), 0, 1, lora=lora).logprobs(batch, steps)

    base = logprobs(AutoModelForCausalLM.from_pretrained(tiny_policy), lora=False)
    reference = logprobs(adapted, lora=True)
    with_adapter = logprobs(adapted, lora=False)
    mask = batch.response_mask
    assert torch.allclose(reference[mask], base[mask], atol=1e-5)
    assert (with_adapter[mask] - base[mask]).abs().max() > 1e-3
    trained = [p for n, p in adapted.named_parameters() if "lora_" in n]
    assert trained and all(p.requires_grad for p in trained)
    assert torch.allclose(logprobs(adapted, lora=False)[mask], with_adapter[mask])
