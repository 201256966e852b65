"""The runner: the Trainer a research model subclasses and the loops around the engine (controller,
run state, actions, workdir, checkpoints, reporting, distribution, the divergence guard)."""
