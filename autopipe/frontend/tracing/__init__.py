"""The model as a LayerGraph: trace (torch.fx, torch.export as fallback), group, fingerprint.

    capture.py         trace with torch.fx, fall back to torch.export; fake-tensor shapes
    keyword_inputs.py  keyword inputs: batched tensors become graph inputs, the rest constants
    node_values.py     every node's output value (node.meta['val']), from a fake run
    diagnose.py        torch's logs silenced around the tracer; the user's line of an error
    failures.py        why a trace failed: each tracer's failure, the fix the TraceError names
    modes.py           one graph for train() and eval()
    shapes.py          every input size dynamic unless the model fixes it
    counted_loss.py    a loss the model computes itself, and how to count the items it averages
    grouping.py        group fx nodes into layers (every layer an interval of the graph)
    granularity.py     layers far finer than the model's modules grouped back to module bounds
    tensor_parallel.py Megatron's column -> row groups and the vocabulary: each layer's TP role
    sequence_parallel.py  the nodes between groups that split by tokens (sequence parallelism)
    repeated.py        trace(repeated=True): a stack of identical blocks traced on 2 and 3, the rest
                       repeated (repeated_graph.py grows the graph), checked against the 3
    graph.py           LayerGraph and trace(): the networkx DAG of layers, its fingerprint
    fx_cut.py          cut a set of fx nodes out as a GraphModule (used by profiling and building)
"""
