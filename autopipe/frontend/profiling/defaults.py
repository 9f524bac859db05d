"""How many runs profile() times by default: read by the command line's help, so it shows the
library's own numbers. Imports nothing, so the command line (and a rank) loads no profiler."""

DEFAULT_REPEATS = 10  # timed runs per layer
DEFAULT_WARMUP = 2  # untimed runs first
