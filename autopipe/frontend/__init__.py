"""The torch frontend: from an nn.Module to a LayerGraph, a measured Profile and stage modules.

One subpackage per job, each importing only the ones before it:

    tracing/    the model as a LayerGraph: torch.fx first, torch.export as fallback, fake-tensor
                shapes, fx nodes grouped into layers, train/eval in one graph, dynamic sizes
    profiling/  the LayerGraph measured into a Profile: each layer timed and metered, the whole
                graph in sequence, the stage-call and recompute overheads, the loss, and the
                distributed runtime's transfer and call costs (``--comm``)
    building/   a Plan + the traced model -> one stage module per stage, made real from weights
                or an init where the model was built on the meta device
"""
