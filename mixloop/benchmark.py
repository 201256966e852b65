"""The command `python -m mixloop.benchmark`: the speed benchmark (mixloop.tools.benchmark)."""

from mixloop import cli
from mixloop.tools import benchmark

if __name__ == "__main__":
    benchmark.define_flags()
    cli.run(benchmark.main)
