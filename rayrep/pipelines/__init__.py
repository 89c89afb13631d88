"""Pipelines of several runs: RLEP's pool collection (`collect`), a replay method against
the GRPO/DAPO baseline on the same budget (`compare`, behind jobs/rlep.py and jobs/exgrpo.py),
and another model's text traces imported into a replay store (`text_import`)."""
