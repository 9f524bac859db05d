"""The torch frontend: from an nn.Module to a LayerGraph, a measured Profile and stage modules.

One subpackage per job, each importing only the ones before it:

    tracing/    the model as a LayerGraph (torch.fx first, torch.export as fallback): its
                fake-tensor shapes, dynamic sizes, fx nodes grouped into layers, train/eval
                in one graph
    profiling/  the LayerGraph measured into a Profile, in three sub-packages: harness/ (each
                layer alone, timed and metered), corrections/ (the whole graph in sequence, the
                stage-call and recompute overheads, the loss) and spawned/ (processes started:
                the distributed runtime's transfer and call costs, ``--comm``, and how much
                slower a rank computes beside another on the same host)
    building/   a Plan + the traced model -> one stage module per stage, made real from weights
                or an init where the model was built on the meta device
"""
