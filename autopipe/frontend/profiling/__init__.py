"""The LayerGraph measured into a Profile on the target device.

    profiler.py       profile(): time and memory of each layer -> Profile
    inputs.py         micro_batch(): the micro-batch of an example batch; device checks
    replay.py         run the traced graph one layer at a time on recorded values
    timing.py         timers and memory meters per device (CPU clock, CUDA events)
    preserve.py       restore RNG and module state after measuring
    layer_timing.py   one layer timed and measured alone
    layerwise.py      each layer alone on the device with made-up inputs (models that never fit)
    overheads.py      the stage call's fixed cost and the recompute / forward ratio
    in_sequence.py    the whole graph timed in sequence; layer_stamps.py: each layer's share
    loss_timing.py    the loss's time per micro-batch
    comm.py           a transfer between two ranks, the distributed runtime's call cost
    rank_contention.py  how much slower ranks sharing a host compute
    process_memory.py peak anonymous resident memory of a region
"""
