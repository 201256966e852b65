"""The runner: the Trainer a research model subclasses, the run built from its hooks, and the loops
around the engine (controller, cadence, recovery, checkpoints, workdir, reporting, distribution)."""
