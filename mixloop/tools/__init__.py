"""The tools, above the runner: the precision doctor's command and the speed benchmark."""
