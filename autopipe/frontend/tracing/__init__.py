"""The model as a LayerGraph: trace (torch.fx, torch.export as fallback), group, fingerprint.

    capture.py    trace with torch.fx, fall back to torch.export; fake-tensor shapes
    diagnose.py   torch's logs silenced around the tracer; the user's line of an error
    modes.py      one graph for train() and eval()
    shapes.py     every input size dynamic unless the model fixes it
    grouping.py   group fx nodes into layers (every layer an interval of the graph)
    graph.py      LayerGraph and trace(): the networkx DAG of layers, its fingerprint
    fx_cut.py     cut a set of fx nodes out as a GraphModule (used by profiling and building)
"""
