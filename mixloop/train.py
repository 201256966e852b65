"""The command line: `python -m mixloop.train --config=PATH[:VARIANT] [--workdir=DIR] [--config.KEY=VALUE]`.

Reads the experiment's config, validates it, builds its Trainer and trains (resuming from the
workdir's latest checkpoint). Bad input is one line on stderr and exit status 2; a diverged run
exits with 3.
"""

from mixloop import cli


def main() -> None:
    config, workdir = cli.experiment_from_flags()
    cli.build_trainer(config, workdir).train()  # It logs the final metrics itself (from Python too).


if __name__ == "__main__":
    cli.run(main)
