"""The LayerGraph measured into a Profile on the target device, by job.

    prof = autopipe.profile(model, (x,), chunks=8)   # profiler.profile, steps in steps.py

Modules:
    profiler          profile(): every layer of one micro-batch, then the corrections -> Profile
    batches           the example batch as profile() takes it: keyword inputs, one row set per size
    steps             the measurement steps in order, each filling one field of Corrections
    layer_rows        every layer measured into its profile row
    _whole_or_layers  the choice between one real run of the whole model and each layer alone
    defaults          DEFAULT_REPEATS, DEFAULT_WARMUP: the runs it times, for the CLI's help
    harness/          the per-layer measuring harness: a layer alone, timed and measured
    corrections/      what layers alone miss, measured on the whole model
    spawned/          experiments that start processes: ranks and neighbours
    estimated/        profile(estimate=SHEET): the harness with a counting timer, on fake tensors

harness/ imports neither corrections/ nor spawned/, and those two never import each other;
estimated/ starts no process (no spawned/) (tests/test_layering.py).
"""
