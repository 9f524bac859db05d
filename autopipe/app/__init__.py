"""The application: the ``autopipe`` command line and the jobs it starts. No library logic.

    config.py       the config dataclasses: every CLI choice and default, in one place
    cli.py          argv -> config -> one library call; AutopipeError -> one line, exit 2
    model_spec.py   MODEL strings (a bundled example or package.module:factory) -> model, inputs
    profile_job.py  `autopipe profile`: measure and save, print a summary
    train.py        `autopipe train`: the whole job in one process
    launch.py       `autopipe run`: start rank_main under torchrun
    rank_main.py    one rank of `autopipe run`
    sigterm_grace.py  a rank's report still written when torchrun's SIGTERM comes first
    _startup.py     a rank's imports with the collector paused, then frozen
"""
