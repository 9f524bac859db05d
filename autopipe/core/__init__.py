"""The torch-free core: the values passed between stages of planning, and the one cost model.

    profile_table.py      Profile: a row per layer (times, bytes), its edges and metadata; CSV+JSON
    corrections.py        Corrections: what a profile measured besides its layers, in one value
    planned_precision.py  the precision a profile was measured under; a warning when it differs
    units.py              byte sizes: parse "16GiB", format for humans
    devices.py            DeviceSpec: a device's name, memory limit and relative speed
    device_sheet.py       DeviceSheet: a device's peak rates, memory and links; [Note: roofline]
    estimated.py          whether a profile was measured or estimated, and on which sheet; never both
    schedules.py          each rank's operation order per schedule (torch's own)
    zero_bubble.py        the zero-bubble schedules' per-rank orders (backward split into I and W)
    scaling.py            a Profile at another micro-batch size
    layer_costs.py        a Profile as numpy arrays in layer order, saved tensors counted once
    cost.py               [Note: cost model] every formula of stage time and memory, written once
    cost_options.py       CostOptions: how stages run (chunks, recompute, optimizer, schedule...), checked
    stage_memory.py       a stage's activation memory: the walk over its schedule's order
    backward_memory.py    what a backward adds: gradients from the first one, each layer's working set
    transfer.py           what crossing a cut costs: the one place a transfer is priced
    recomputed_layers.py  chosen layers recomputed inside a stage: what they free, what they cost
    data_parallel.py      replicas of the pipeline: what data parallelism adds to a stage
    tensor_parallel.py    TP roles of layers, and the profile one rank of a TP group of degree t runs
    stage_cost.py         StageCost: one stage's predicted time and memory, the parts kept apart
    plan.py               Plan: stages, devices and predicted cost; JSON
    plan_checks.py        a loaded Plan's fields checked, each bad one a PlanError line
    plan_fit.py           a split against a graph: each layer in one stage, no edge back, the fingerprint
    plan_text.py          a Plan in words: table, explain()
    simulator.py          simulate(): event simulation of a schedule (timeline, bubble, peaks)
    atomic_files.py       atomic writes that never leave a half-written profile, plan or image

Nothing here imports torch (tests/core/test_torch_free.py runs it with torch blocked).
"""
