"""The torch-free core: the values passed between stages of planning, and the one cost model.

    profile_table.py  Profile: one row per layer (times, bytes), its edges and metadata; CSV+JSON
    units.py          byte sizes: parse "16GiB", format for humans
    schedules.py      each rank's operation order per schedule (torch's own)
    scaling.py        a Profile at another micro-batch size
    cost.py           [Note: cost model] every formula of stage time and memory, written once
    plan.py           Plan: stages, devices and predicted cost; JSON
    plan_text.py      a Plan in words: table, explain()
    simulator.py      simulate(): event simulation of a schedule (timeline, bubble, peaks)
    files.py          atomic writes that never leave a half-written profile, plan or image

Nothing here imports torch (tests/core/test_torch_free.py runs it with torch blocked).
"""
