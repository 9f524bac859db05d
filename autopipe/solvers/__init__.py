"""Torch-free solvers that balance a Profile's layers into stages: ``partition()``.

    partitioner.py  partition(profile, stages=K, ...) -> Plan: picks and runs a solver
    dp.py           exact min-max split of the layers' topological order
    ilp.py          PuLP/CBC over the whole DAG, warm-started from the DP
    baselines.py    equal layer counts, DeepSpeed's parameter balance, torchgpipe's blockpartition
    synthetic.py    deterministic chain and transformer-DAG profiles for tests and benchmarks

Every solver reads stage costs from autopipe.core.cost; none writes a formula of its own.
"""
