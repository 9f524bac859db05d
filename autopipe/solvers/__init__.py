"""Torch-free solvers that balance a Profile's layers into stages: ``partition()``.

    partitioner.py      partition(profile, stages=K|"auto", ...) -> Plan: picks and runs a solver
    data_parallel_search.py  the replica count D ("auto"): one search per divisor of the devices
    tensor_parallel_search.py  the TP degree t ("auto"): devices as PP x TP x DP, one plan per degree
    search.py           the automatic search: stages, chunks, recomputation, schedule
    search_space.py     what the search chooses from (ranks, micro-batches, schedules, layouts), and its results
    bounds.py           lower bounds on a simulated iteration, for the search's pruning and the gaps
    stage_dp.py         exact min-max split with a recompute mode per stage, all stage counts
    fixed_config.py     one given configuration: the exact DP, the ILP where it can gain, a baseline
    dp.py               the DP for one configuration, and why nothing fits
    step_split.py       method="step": the split with the shortest simulated step, not bottleneck
    split_steps.py      many splits' simulated steps at once, a bound that is the step for one replica
    layer_recompute.py  after the split: recompute a few layers instead of a whole stage
    block_recompute.py  where no stage mode fits: every repeated block recomputed alone, on a few splits
    dag_bound.py        when the ILP can beat the DP: a lower bound over every DAG split
    ilp.py              PuLP/CBC over the whole DAG, warm-started from the DP
    cbc_log.py          CBC's log read as it is written: incumbent, bound and gap, progress
    baselines.py        equal layer counts, DeepSpeed's parameter split, torchgpipe's blockpartition
    defaults.py         the ILP's default time limits (read by the command line's help)
    synthetic.py        deterministic chain and transformer-DAG profiles for tests and benchmarks,
                        and the chains torch's auto_partition is tested on

Every solver reads stage costs from autopipe.core.cost; none writes a formula of its own.
"""
