from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from autopipe.app.cli import main
from autopipe.core.profile_table import Profile

FAST = ["--repeats", "2", "--warmup", "0"]


def test_profile_bundled_example(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mlp.csv"
    rc = main(["profile", "mlp", "--batch-size", "8", "--chunks", "2", "--out", str(out),
               "--threads", "1", *FAST])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    lines = cap.out.splitlines()
    assert lines[0] == f"the 10 heaviest of 15 layers (forward + backward), heaviest first; every layer is in {out}"
    rows = lines[3:13]  # the 10 heaviest, heaviest first, then the totals
    ms = [float(r.split()[2]) + float(r.split()[3]) for r in rows]
    # sorted by the exact times; each printed time is rounded to 0.001 ms, so neighbours may
    # differ by up to 0.002 ms in the other direction
    assert all(a >= b - 0.002 for a, b in zip(ms, ms[1:], strict=False)) and lines[13].startswith("---")
    assert lines[14].startswith("total (15 layers)") and f"wrote {out}" in cap.out
    assert "profiling" in cap.err  # the progress bar goes to stderr
    prof = Profile.load(out)
    assert (prof.meta["model"], prof.meta["micro_batch_size"], prof.meta["batch_size"]) == ("mlp", 4, 8)
    assert prof.meta["cpu_threads"] == 1 and prof.meta["repeats"] == 2
    assert (tmp_path / "mlp.json").exists()
    # an example brings its loss: timed per micro-batch, reported, charged to the last stage
    loss = prof.corrections.loss
    assert loss is not None and loss.fwd_ms > 0 and loss.micro_batch_size == 4
    assert any(line.startswith("the loss: ") for line in lines)


def test_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "chain.csv"
    argv = ["profile", "tests.models:make_chain", "--out", str(out), *FAST]
    assert main(argv) == 0
    before = out.read_bytes(), out.with_suffix(".json").read_bytes()
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopipe: error: ") and "refusing to overwrite" in err and "--force" in err
    assert err.count("\n") == 1
    assert (out.read_bytes(), out.with_suffix(".json").read_bytes()) == before
    assert main([*argv, "--force"]) == 0
    assert out.with_suffix(".json").read_bytes() != before[1]  # a new date and timings


def test_factory_with_batch_size_and_default_out(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["profile", "tests.models:make_chain", "--batch-size", "6", "--chunks", "3", *FAST]) == 0
    prof = Profile.load(tmp_path / "profiles" / "make_chain.csv")
    assert (prof.meta["model"], prof.meta["micro_batch_size"]) == ("make_chain", 2)


def test_bare_model_with_input_shape(tmp_path: Path) -> None:
    out = tmp_path / "bare.csv"
    assert main(["profile", "tests.models:Chain", "--input-shape", "8", "--batch-size", "4",
                 "--out", str(out), *FAST]) == 0
    assert Profile.load(out).layers[0] == "net.0"


def test_leaf_and_max_depth(tmp_path: Path) -> None:
    main(["profile", "cnn", "--batch-size", "2", "--chunks", "1", "--leaf", "ResBlock", "--leaf", "head",
          "--out", str(tmp_path / "a.csv"), *FAST])
    layers = Profile.load(tmp_path / "a.csv").layers
    assert {"blocks.0", "blocks.3", "head"} <= set(layers) and len(layers) < 12
    main(["profile", "cnn", "--batch-size", "2", "--chunks", "1", "--max-depth", "1", "--out", str(tmp_path / "b.csv"), *FAST])
    assert "blocks" in Profile.load(tmp_path / "b.csv").layers


def test_a_factory_of_a_keyword_batch_profiles_for_the_pipeline_of_that_batch(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import autopipe
    from autopipe.app.config import RunConfig
    from autopipe.app.launch import run
    from tests.models import make_hf_batch

    out = tmp_path / "llama.csv"
    assert main(["profile", "tests.models:make_hf_batch", "--batch-size", "8", "--chunks", "2",
                 "--out", str(out), "--no-progress", *FAST]) == 0, capsys.readouterr().err
    model, batch = make_hf_batch(8)
    # the profile is of the graph the pipeline traces from the same batch: its fingerprint is checked
    pipe = autopipe.pipeline(model, example_kwargs=batch, profile=Profile.load(out), devices=["cpu", "cpu"],
                             chunks=2)
    torch.testing.assert_close(pipe(**batch).loss, make_hf_batch(8)[0](**batch).loss)
    # the command line trains positional inputs only: one line that says how to train it
    with pytest.raises(Exception, match=r"returned a keyword batch, which autopipe run does not take .*"
                                        r"autopipe\.pipeline\(model, example_kwargs=batch"):
        run(RunConfig("tests.models:make_hf_batch", nproc=2, batch_size=8), log_dir=tmp_path)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["nocolon"], "neither a bundled example"),
        (["no_such_module_xyz:make"], "cannot import module 'no_such_module_xyz'"),
        (["tests.models:nothing"], "has no attribute 'nothing'"),
        (["tests.models:NOT_CALLABLE"], "is a int, not callable"),
        (["tests.models:make_wrong"], "returned int; it must return an nn.Module"),
        (["tests.models:make_raises"], "raised RuntimeError: boom; fix the factory"),
        (["tests.models:Chain"], "pass --input-shape"),
        (["tests.models:Chain", "--input-shape", "3,x"], "is not a shape"),
        (["tests.models:make_chain", "--input-shape", "8"],
         r"factory 'tests.models:make_chain' returns its own inputs, so --input-shape 8 would be ignored; "
         r"drop --input-shape \(it is for factories returning a bare model\)$"),
        (["tests.models:make_hf_batch", "--input-shape", "8"],
         r"factory 'tests.models:make_hf_batch' returns its own inputs, so --input-shape 8 would be ignored"),
        (["mlp", "--input-shape", "64"], r"the bundled example 'mlp' brings its own inputs: drop --input-shape$"),
        (["tests.models:make_fixed_batch", "--batch-size", "8"], "inputs of batch 4 but --batch-size is 8"),
        (["mlp", "--batch-size", "2", "--chunks", "4"], r"chunks=4 > batch size 2"),
        (["mlp", "--batch-size", "0"], "batch size must be >= 1"),
        (["mlp", "--leaf", "nope"], "--leaf 'nope' names neither a submodule"),
        (["mlp", "--threads", "0"], "--threads must be >= 1"),
        (["mlp", "--repeats", "0"], "repeats must be an int >= 1"),
        (["mlp", "--device", "cuda" if not torch.cuda.is_available() else "cuda:99"],
         "CUDA is not available|does not exist"),
    ],
)
def test_bad_input_is_one_line_error(
    argv: list[str], match: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x.csv"
    assert main(["profile", "--out", str(out), *FAST, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("autopipe: error: "), err
    assert re.search(match, err[0]), err[0]
    assert not out.exists()


def test_a_factory_in_the_current_directory_needs_no_pythonpath(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "here_factory.py").write_text(
        "import torch\nfrom torch import nn\n\ndef with_inputs(batch_size):\n"
        "    return nn.Sequential(nn.Linear(4, 4), nn.ReLU()), torch.randn(batch_size, 4)\n")
    (tmp_path / "broken_factory.py").write_text("import not_installed_package_xyz\n")
    (tmp_path / "typo_factory.py").write_text("def make(:\n")
    monkeypatch.chdir(tmp_path)  # as `python -m` would, the current directory is importable
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("here_factory", "broken_factory", "typo_factory"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    assert main(["profile", "here_factory:with_inputs", "--batch-size", "4", "--chunks", "2", *FAST]) == 0
    assert Profile.load(tmp_path / "profiles" / "with_inputs.csv").meta["micro_batch_size"] == 2
    capsys.readouterr()
    for spec, line in [
        ("broken_factory:make", "importing module 'broken_factory' of model 'broken_factory:make' failed "
         "(ModuleNotFoundError: No module named 'not_installed_package_xyz'); fix that import in "
         "'broken_factory' (is the package it needs installed?)"),
        ("typo_factory:make", "importing module 'typo_factory' of model 'typo_factory:make' raised "
         "SyntaxError: invalid syntax (typo_factory.py, line 1); fix the module"),
        ("absent_factory:make", "cannot import module 'absent_factory' of model 'absent_factory:make' "
         f"(ModuleNotFoundError: No module named 'absent_factory'); check the name: absent_factory.py must "
         f"be in the current directory ({tmp_path}) or on PYTHONPATH"),
    ]:
        assert main(["profile", spec, *FAST]) == 2
        assert capsys.readouterr().err == f"autopipe: error: {line}\n"


def test_profile_a_model_built_on_meta(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpt.csv"
    assert main(["profile", "gpt", "--meta", "--batch-size", "4", "--chunks", "2", "--repeats", "1",
                 "--warmup", "0", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"profiled layer by layer: \d+ of 52 layers measured", text), text
    prof = Profile.load(out)
    assert prof.meta["mode"] == "layers" and prof.meta["measured_layers"] < len(prof)
    whole = Profile.load(Path(__file__).resolve().parents[2] / "profiles" / "gpt.csv")
    assert prof.fingerprint.split(".")[1] == whole.fingerprint.split(".")[1]  # the same model
    assert main(["profile", "gpt", "--meta", "--mode", "whole", "--batch-size", "4", "--chunks", "2",
                 "--out", str(tmp_path / "g2.csv")]) == 2
    assert "cannot run whole; profile it layer by layer" in capsys.readouterr().err


def test_profile_several_micro_batch_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mlp.csv"
    assert main(["profile", "mlp", "--batch-size", "8", "--chunks", "4", "--micro-batch-sizes",
                 "1,4", "--out", str(out), "--no-progress", *FAST]) == 0
    prof = Profile.load(out)
    assert prof.meta["micro_batch_sizes"] == [1, 2, 4] and "fwd_ms@4" in prof.df.columns
    capsys.readouterr()
    assert main(["profile", "mlp", "--micro-batch-sizes", "1,x", "--out", str(tmp_path / "b.csv")]) == 2
    assert "--micro-batch-sizes '1,x': give row counts >= 1 separated by commas" in capsys.readouterr().err


def test_profile_under_a_precision_records_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mlp.csv"
    assert main(["profile", "mlp", "--batch-size", "8", "--chunks", "2", "--out", str(out),
                 "--precision", "bf16", "--no-progress", *FAST]) == 0, capsys.readouterr().err
    assert Profile.load(out).meta["precision"] == "bf16"
    assert main(["profile", "mlp", "--out", str(tmp_path / "x.csv"), "--precision", "fp8"]) == 2
    assert "--precision" in capsys.readouterr().err and not (tmp_path / "x.csv").exists()
