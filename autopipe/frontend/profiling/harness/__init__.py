"""The per-layer measuring harness: one layer alone, on recorded or made-up inputs.

Modules:
    replay          the traced graph one layer at a time, on recorded values
    layerwise       each layer alone with made-up inputs (models that never fit)
    layer_timing    one layer timed and measured alone, forward and backward
    backward_split  a layer's backward in two halves, as the zero-bubble schedules run it
    under_autocast  every forward the profiler runs entered under the stage's precision
    one_weight      OneWeight: a layer that is nothing but its call
    timing          device timers and memory meters
    inputs          the micro-batch of an example batch; device checks; moving values
    preserve        a model left exactly as it was after measuring
    process_memory  this process's anonymous resident memory and its peak over a region
"""
