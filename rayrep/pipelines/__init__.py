"""Pipelines of several runs: RLEP's pool collection (`collect`), and a replay method against
the GRPO/DAPO baseline on the same budget (`compare`, behind jobs/rlep.py and jobs/exgrpo.py)."""
