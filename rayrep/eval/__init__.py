"""Evaluation, one floor above the roles: the one path that evaluates a policy on a run's
generators and verifiers (`evaluate`) and the report (`report`). The formulas it uses are pure statistics on the bottom
floor (`rayrep.stats.formulas`: avg@k, unbiased pass@k, the standard error; maj@k votes with
the verifier, `rayrep.verifier.voting`); their names here are stable:
`rayrep.eval.pass_at_k`, `rayrep.eval.maj_at_k`."""

from rayrep.stats.formulas import (avg_at_k, mean_and_se, pass_at_k, pass_ks, standard_error, summarize,
                                  summarize_by_source)
from rayrep.verifier.voting import maj_at_k

__all__ = ["avg_at_k", "maj_at_k", "mean_and_se", "pass_at_k", "pass_ks", "standard_error", "summarize",
           "summarize_by_source"]
