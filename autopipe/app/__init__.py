"""The application: the ``autopipe`` command line and the jobs it starts. No library logic.

    config.py            the config dataclasses: every CLI choice and default, in one place
    flag_groups.py       flag groups commands share: PrecisionFlags, LoopFlags, one check each
    checkpoint_flags.py  the checkpoint and restart flags that TrainConfig and RunConfig inherit
    sheet_flags.py       the device-sheet flags: profile's --estimate, calibrate's config
    flags.py             argparse from the config dataclasses: one flag per field
    cli.py               argv -> config -> one library call; AutopipeError -> one line, exit 2
    model_spec.py        MODEL strings (bundled example or package.module:factory) -> model, inputs
    profile_job.py       `autopipe profile`: measure and save, print a summary
    comm_job.py          `autopipe comm`: two ranks time the link between them, for --comm-from
    calibrate_job.py     `autopipe calibrate`: this device measured into a device sheet
    train.py             `autopipe train`: the whole job in one process
    run_checkpoints.py   checkpoints of train and run: when to save, what a resume loads
    launch.py            `autopipe run`: start rank_main under torchrun
    nodes.py             where a torchrun launch's ranks run: the node flags, torchrun's flags
    torchrun.py          torchrun over the rank modules: its command line, run, failures in one line
    restart_watch.py     torchrun's stderr read as it comes: each failed attempt and its restart
    rank_main.py         one rank of `autopipe run`
    faults.py            testing hook: AUTOPIPE_FAULT makes a rank die or hang on purpose
    sigterm_grace.py     a rank's report still written when torchrun's SIGTERM comes first
    _startup.py          a rank's imports with the collector paused, then frozen
"""
