"""executor.local: GPipe in one process, over the devices it sees (torchgpipe's runtime).

    from executor import GPipe
    pipe = GPipe(stages, devices=["cuda:0", "cuda:1"], chunks=8)

Modules:
    gpipe        GPipe: stages on devices, micro-batches in fill-drain order, gradients
                 accumulated over the mini-batch
    stage_task   one (stage, micro-batch) forward as a task for its device's worker, and the loss
    fill_drain   the fill-drain clock cycles, a pure function of (micro-batches, stages)
    worker       one worker thread per device: where the stages' forwards run
    stream       CUDA streams behind one interface (a no-op on the CPU), stream-aware copies
    placement    stages onto their devices: checks, moves, parameters tied across devices
    timeline     per (stage, micro-batch, phase) times of one step, as a Chrome trace
    batchnorm    DeferredBatchNorm: running statistics once per mini-batch
    state_keys   the pipeline's state_dict under the original model's keys

Imports the shared runtime (executor.spec, microbatch, recompute, precision, ...) and
executor.checkpoint, never executor.ranks (tests/test_layering.py).
"""
