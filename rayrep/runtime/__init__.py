"""The running system (`system.Runtime`): every role's actors, started and stopped together,
the weight sync between learners and generators (`weights`), and the GPU memory plan that
is checked before anything starts (`memory`). Light to import: the modules bring in what
they need."""
