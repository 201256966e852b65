"""The tools, apart from engine and runner: the precision doctor and the speed benchmark."""
