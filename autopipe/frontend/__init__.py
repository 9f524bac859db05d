"""The torch frontend: from an nn.Module to a LayerGraph, a measured Profile and stage modules.

    capture.py    trace with torch.fx, fall back to torch.export; fake-tensor shapes
    grouping.py   group fx nodes into layers (every layer an interval of the graph)
    graph.py      LayerGraph and trace(): the networkx DAG of layers, its fingerprint
    fx_cut.py     cut a set of fx nodes out as a GraphModule (used by replay and stages)
    replay.py     run the traced graph one layer at a time on recorded values
    timing.py     timers and memory meters per device (CPU clock, CUDA events)
    preserve.py   restore RNG and module state after measuring
    inputs.py     micro_batch(): the micro-batch of an example batch; device checks
    profiler.py   profile(): time and memory of each layer -> Profile
    comm.py       with_comm(): a transfer between two ranks, the distributed runtime's call cost
    layerwise.py  each layer alone on the device with made-up inputs (models that never fit)
    stages.py     build(): a Plan + the traced model -> one nn.Module per stage
    weights.py    named tensors from weights files, read a few at a time
    materialize.py  meta-built stages made real one at a time, from weights or an init
"""
