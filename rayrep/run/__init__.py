"""A training run's lifecycle around the loop of `rayrep.train` (`lifecycle.Run`): its folder
(`layout`), checkpoints and resume (`checkpoints`), evaluations (`evaluation`), the step's
record (`record`) and log (`log`), and what happens when a learner dies (`restarts`).
Light to import: the modules bring in what they need."""
