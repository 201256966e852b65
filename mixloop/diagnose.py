"""The command `python -m mixloop.diagnose`: the precision doctor (mixloop.tools.diagnose)."""

from mixloop import cli
from mixloop.tools import diagnose

if __name__ == "__main__":
    cli.run(diagnose.main)
