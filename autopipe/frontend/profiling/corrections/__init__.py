"""What each layer measured alone misses, measured on the whole model into Corrections.

Modules:
    overheads     the fixed cost of a stage call, the real recompute cost
    in_sequence   the layers run in sequence: what timing each alone gets wrong
    layer_stamps  each layer's share of the whole graph's forward and backward
    loss_timing   what the loss costs the last stage
"""
