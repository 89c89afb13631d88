"""The roles of a run as one running system (`system.Runtime`): every role's actors, started
and stopped together, and the turns they take on shared GPUs (`turns`). The weight sync between learners and
generators is `rayrep.sync.weights`; the GPU memory plan checked before anything starts and
the ledger that follows it, `rayrep.cluster.memory`. Light to import: the modules bring in
what they need."""
