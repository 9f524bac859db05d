"""What the resume tests share: tiny tied LMs with dropout (autopipe's TinyGPT, "tiny", and
HuggingFace's GPT-2, "gpt2"), their batches, AdamW + StepLR, a plain-model reference, and every
tensor of a training run keyed by the plain model's names.

A run is "train steps [start, stop) of one trajectory": the same global batch per step
whatever the plan (made by a generator of its own, so the RNG that dropout draws from never
makes batches), split across replicas as [Note: replicas on a mesh] says (replica r: rows
r/D of it), each replica's share split into ``CHUNKS`` micro-batches. The losses are means, so
every plan follows the plain model's trajectory on the whole batch (to rounding), and the same
plan follows its own bit for bit.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from autopipe.examples import TinyGPT

CHUNKS, ROWS, VOCAB, LEN = 2, 8, 16, 4
LR, WEIGHT_DECAY = 0.02, 0.1
# Adam's eps, above rounding noise: the key projection's bias has an exactly zero gradient
# (softmax ignores a shift shared by all keys), so its "gradient" is rounding (~1e-9), different
# under each plan, which eps=1e-8 would turn into full-size steps of either sign.
EPS = 1e-4
DROPOUT = 0.2  # the same-plan cases: the saved RNG states must replay these masks
STEPS, SAVED_AT = 6, 3


def model(dropout: float = 0.0, case: str = "tiny") -> nn.Module:
    """The same initial weights every time (its own seed), the head tied to the embedding."""
    torch.manual_seed(0)
    if case == "tiny":
        return TinyGPT(vocab=VOCAB, dim=8, heads=2, layers=2, max_len=LEN, dropout=dropout)
    import transformers

    transformers.logging.set_verbosity_error()
    cfg = transformers.GPT2Config(n_layer=2, n_embd=8, n_head=2, vocab_size=VOCAB, n_positions=LEN,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=dropout,
                                  embd_pdrop=dropout, attn_pdrop=dropout)
    return transformers.GPT2LMHeadModel(cfg)


def lm_loss(out: Any, target: Tensor) -> Tensor:
    logits = getattr(out, "logits", out)  # a HuggingFace model's output, or the logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def batch(step: int, replica: int = 0, replicas: int = 1) -> tuple[Tensor, Tensor]:
    """Step ``step``'s global batch (inputs, target), or replica ``replica``'s rows of it."""
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, VOCAB, (ROWS, LEN), generator=g)
    y = torch.randint(0, VOCAB, (ROWS, LEN), generator=g)
    return x.tensor_split(replicas)[replica], y.tensor_split(replicas)[replica]


def optimizer(params: Iterable[nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW and a StepLR that halves the rate every 2 steps (it changes across the resume)."""
    opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


Traces = dict[tuple[float, str, int], tuple[nn.Module, Any]]


def _stored(traces: Traces, dropout: float, case: str, replicas: int) -> tuple[nn.Module, Any]:
    key = (dropout, case, replicas)
    if key not in traces:
        from autopipe.assemble.setup import microbatch_inputs
        from autopipe.frontend.tracing.graph import trace

        made = model(dropout, case)
        traces[key] = made, trace(made, microbatch_inputs(batch(0, 0, replicas)[:1], CHUNKS))
    return traces[key]


def traced(traces: Traces, dropout: float = 0.0, case: str = "tiny", replicas: int = 1) -> tuple[nn.Module, Any]:
    """``model(dropout, case)`` and its graph (``autopipe.trace`` on the first micro-batch of one
    replica's batch), for a pipeline's ``graph=``. A run builds several pipelines of one model,
    and tracing is most of a build: each (dropout, case, replicas) is traced once per ``traces``
    (one test's, or one call of the ranks'), and every call gets a deep copy of that model and
    its graph together (the copy's graph holds the copy's tensors; the stored model, seeded as
    :func:`model` seeds it, never builds a pipeline), nothing shared with another call's."""
    with warnings.catch_warnings():  # torch's pytree specs warn as they are copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(_stored(traces, dropout, case, replicas))


def plan(stages: int, replicas: int = 1, dp_mode: str = "ddp", schedule: str = "gpipe",
         case: str = "tiny", traces: Traces | None = None) -> dict[str, Any]:
    """A uniform plan of ``stages`` for one replica's batch from made-up costs of the graph
    ``traces`` holds (:func:`traced`): the same plan in every process that makes it."""
    from autopipe.solvers.partitioner import partition
    from tests.assemble.test_local import cost_profile

    graph = _stored({} if traces is None else traces, 0.0, case, replicas)[1]
    made = partition(cost_profile(graph), stages=stages, method="uniform", chunks=CHUNKS,
                     schedule=schedule)
    return dataclasses.replace(made, data_parallel=replicas, dp_mode=dp_mode).to_dict()


def train_steps(step: Any, opt: torch.optim.Optimizer, scheduler: Any, start: int, stop: int) -> None:
    """``step(x, y)`` runs one forward and backward; then AdamW and the scheduler step."""
    for n in range(start, stop):
        opt.zero_grad()
        step(n)
        opt.step()
        scheduler.step()


def reference(case: str = "tiny", stop: int = STEPS) -> dict[str, Tensor]:
    """The plain model (dropout off) trained ``stop`` steps on the whole batch."""
    m = model(case=case)
    opt, scheduler = optimizer(m.parameters())

    def step(n: int) -> None:
        x, y = batch(n)
        lm_loss(m(x), y).backward()

    train_steps(step, opt, scheduler, 0, stop)
    return named_state(m.state_dict(keep_vars=True), opt)


def _full(t: Tensor) -> Tensor:
    """A copy of the whole tensor (an FSDP shard: gathered, a collective over its column)."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def named_state(tensors: dict[str, Tensor], opt: torch.optim.Optimizer,
                aliases: dict[str, list[str]] | None = None) -> dict[str, Tensor]:
    """``model.<name>`` and ``optim.<name>.<state>`` (every name of a tie) for the model
    tensors ``tensors`` (state_dict keys, keep_vars) hold, independently of the checkpoint
    code: what a run's end is compared on. ``aliases``: a key -> every name of its tensor."""
    aliases = aliases or {}
    out: dict[str, Tensor] = {}
    names: dict[int, list[str]] = {}
    for key, tensor in tensors.items():
        for name in aliases.get(key, [key]):
            out[f"model.{name}"] = _full(tensor)
            names.setdefault(id(tensor), []).append(name)
    for group in opt.param_groups:
        for p in group["params"]:
            for state, value in opt.state[p].items():
                for name in names[id(p)]:
                    out[f"optim.{name}.{state}"] = _full(value)
    out["lr"] = torch.tensor([g["lr"] for g in opt.param_groups])
    return out


def pipeline_state(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, Tensor]:
    """A distributed pipeline rank's :func:`named_state` (every rank: FSDP gathers)."""
    pipe.state_dict()  # FSDP: reshard, so that the parameters are the optimizer's DTensors
    tensors = {key: t for stage in pipe.stages for key, t in stage.state_dict(keep_vars=True).items()}
    return named_state(tensors, opt, pipe.key_aliases)
