"""A Plan + the traced model -> stage modules, made real one stage at a time.

    stages.py       build(): one GraphModule per stage over the model's own submodules
    weights.py      named tensors from weights files, read a few at a time
    materialize.py  meta-built stages made real one at a time, from weights or an init
    tensor_parallel.py  a stage rewritten for one rank of a tensor-parallel group
    sequence_parallel.py  the same stage's values between groups on the rank's tokens only
"""
