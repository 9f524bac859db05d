"""How long the ILP may run by default: read by the command line's help, so it shows the
library's own numbers. Imports nothing, so the command line (and a rank) loads no solver."""

ILP_TIME_LIMIT = 5.0  # seconds of CBC for one configuration unless time_limit says otherwise
SEARCH_ILP_TIME_LIMIT = 2.0  # seconds of CBC per configuration in a search, the same
