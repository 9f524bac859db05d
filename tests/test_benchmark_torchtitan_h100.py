"""benchmarks/torchtitan_h100.py runs tiny: a one-layer Llama of hidden 64 (the 8B's vocabulary)
in place of the 8B at 256 tokens, estimated and planned as FSDP on 8 and 128 GPUs. Times are
the report's; that recomputing every layer never needs more memory than recomputing none is a
fact of the bytes. About 10 s (an HF Llama built, traced and counted), so it is marked slow."""

from __future__ import annotations

import pytest
import torch

from benchmarks import torchtitan_h100


@pytest.mark.slow
def test_torchtitan_comparison_runs_tiny(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")

    def tiny(layers: int) -> torch.nn.Module:
        config = transformers.LlamaConfig(vocab_size=128256, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2)
        with torch.device("meta"):
            return transformers.LlamaForCausalLM(config)

    monkeypatch.setattr(torchtitan_h100, "llama31_8b", tiny)
    rows = torchtitan_h100.main(["--layers", "1", "--seq", "256"])
    assert len(rows) == 2 + 2 * len(torchtitan_h100.PUBLISHED)
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]
    assert [c[0] for c in cells] == ["8", "8", "128", "128"]
    for none, every in (cells[0:2], cells[2:4]):
        assert none[2] == "no recomputation" and every[2] == "every layer recomputed"
        assert float(every[5]) <= float(none[5])  # GiB per GPU
        assert float(none[3].replace(",", "")) > 0
    assert "estimated on h100-titan" in capsys.readouterr().err
