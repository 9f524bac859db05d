"""Torch-free solvers that balance a Profile's layers into stages: ``partition()``.

    partitioner.py  partition(profile, stages=K|"auto", ...) -> Plan: picks and runs a solver
    search.py       the automatic search: stages, chunks, recomputation, schedule
    bounds.py       lower bounds on a simulated iteration, for the search's pruning
    stage_dp.py     exact min-max split with a checkpoint mode per stage, all stage counts
    dp.py           the DP for one configuration, and why nothing fits
    ilp.py          PuLP/CBC over the whole DAG, warm-started from the DP
    baselines.py    equal layer counts, DeepSpeed's parameter balance, torchgpipe's blockpartition
    synthetic.py    deterministic chain and transformer-DAG profiles for tests and benchmarks

Every solver reads stage costs from autopipe.core.cost; none writes a formula of its own.
"""
