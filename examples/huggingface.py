"""A HuggingFace model as a pipeline: its own batches and loss, trained, saved as the model.

    python examples/huggingface.py --steps 5 --out out/llama-pipelined

Builds a small Llama from a config (no weights are downloaded), splits it over two devices
(``--devices cuda:0 cuda:1`` on a GPU host; two CPU "devices" here), trains it on HF-style
batches (``input_ids``, ``attention_mask``, ``labels`` with right padding) through
``pipe(**batch)``, whose loss is the model's own, weighted by counted tokens as on the whole
batch, then saves it with ``pipe.save_pretrained`` and loads it back with
``AutoModelForCausalLM.from_pretrained`` to check that the saved model computes what the
pipeline computes. See docs/guide/huggingface.md.
"""

from __future__ import annotations

import argparse
import warnings

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import autopipe

VOCAB = 256


def batch_of(step: int, rows: int, length: int = 16) -> dict[str, torch.Tensor]:
    """A batch as a tokenizer and collator give it: right padding masked, padded labels -100."""
    g = torch.Generator().manual_seed(step)
    ids = torch.randint(1, VOCAB, (rows, length), generator=g)
    lengths = torch.randint(length // 2, length + 1, (rows,), generator=g)
    mask = (torch.arange(length) < lengths[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--chunks", type=int, default=4)
    p.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    p.add_argument("--out", required=True, help="a folder for save_pretrained (kept if it holds a saved model)")
    args = p.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    with warnings.catch_warnings():  # two stages on one CPU (the plan says so), torch.export's own
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", FutureWarning)
        pipe = autopipe.pipeline(model, example_kwargs=batch_of(0, args.batch_size), devices=args.devices,
                                 chunks=args.chunks)
    print(f"{len(pipe.stages)} stages: {pipe.plan.spans()}")
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3)
    for step in range(args.steps):
        opt.zero_grad()
        out = pipe(**batch_of(step % 2, args.batch_size))  # the model's own output type and loss
        out.loss.backward()
        opt.step()
        print(f"step {step + 1}/{args.steps}  loss {out.loss.item():.4f}")

    index = pipe.save_pretrained(args.out)
    print(f"saved {index}")
    loaded = AutoModelForCausalLM.from_pretrained(args.out).eval()
    batch = batch_of(args.steps, args.batch_size)
    with torch.no_grad():
        same = torch.allclose(loaded(**batch).logits, pipe.eval()(**batch).logits.to("cpu"), atol=1e-5)
    print(f"from_pretrained({args.out!r}): {'the same' if same else 'DIFFERENT'} logits as the pipeline")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
