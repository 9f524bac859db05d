"""executor.ranks: one rank's pipeline stages on torch.distributed.pipelining, under torchrun.

    from executor import DistributedPipeline
    pipe = DistributedPipeline(stages, stage_ids, schedule="1f1b", chunks=8, ...)

Modules:
    distributed      DistributedPipeline: this rank's stages under one of executor.spec.SCHEDULES
    step_inputs      a step's inputs: bound, checked, their sizes agreed, and the schedule for them
    replicated       replicas on a 2-D DeviceMesh: data parallel across, pipeline along
    torch_schedules  the torch schedule class that runs each schedule, and how it is driven
    prefetch         GPipe with every receive posted ahead of time
    split_backward   the zero-bubble schedules' backward in two: input, then weight gradients
    wire             how a stage's live values cross a process boundary as tensors
    messages         the few messages a cut's wires travel in between two ranks
    sized            one set of PipelineStages and a schedule per input size
    symbolic         fake runs at symbolic sizes: shapes as formulas of the inputs'
    watchdog         one thread that bounds every pipeline step of the process
    peer_failures    a peer rank's failure as one exception naming the rank, step and cause
    rank_cores       which CPU cores a rank runs on when ranks share a host
    rank_state       a rank's state_dict part under the original model's keys
    ties             which ranks hold a parameter that stages share, this rank's copy, and
                     its gradient summed over them after each step
    grad_scaler      fp16 loss scaling whose found-inf every rank shares
    tensor_parallel  a TP group's collectives as modules, and the (dp, pp, tp) DeviceMesh

Imports the shared runtime (executor.spec, microbatch, recompute, precision, ...) and
executor.checkpoint, never executor.local (tests/test_layering.py).
"""
