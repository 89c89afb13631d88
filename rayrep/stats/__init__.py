"""Pure statistics, on the package's bottom floor (they import nothing of rayrep but each
other): the evaluation formulas (`formulas`: avg@k, unbiased pass@k, the standard error) and a
seeded study's comparisons of runs (`study`). The evaluation that runs a policy is
`rayrep.eval`, above the runtime; its stable names (`rayrep.eval.pass_at_k`, ...) are these."""
