from __future__ import annotations

import re
from pathlib import Path

import pytest

from autopipe.app.cli import main
from autopipe.core.plan import Plan
from autopipe.solvers.synthetic import random_chain


@pytest.fixture()
def profile_csv(tmp_path: Path) -> Path:
    return random_chain(12, 5).save(tmp_path / "profiles" / "toy")


def test_partition_then_simulate(profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plans" / "toy.json"
    assert main(["partition", str(profile_csv), "--stages", "3", "--chunks", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "bottleneck" in text and "share" in text and f"wrote {out}" in text
    plan = Plan.load(out)
    assert plan.num_stages == 3 and plan.chunks == 4 and plan.method == "exact"
    assert main(["simulate", str(out), "--profile", str(profile_csv), "--schedule", "1f1b"]) == 0
    text = capsys.readouterr().out
    assert "schedule 1f1b" in text and "stage 2" in text


def test_partition_without_out_prints_the_plan_and_saves_nothing(
        profile_csv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    before = sorted(p for p in tmp_path.rglob("*"))
    assert main(["partition", str(profile_csv), "--stages", "2"]) == 0
    text = capsys.readouterr().out
    assert "bottleneck" in text and "share" in text
    assert text.rstrip().endswith("not saved: pass --out plans/NAME.json to keep this plan")
    assert sorted(p for p in tmp_path.rglob("*")) == before


def test_the_old_checkpoint_flag_still_sets_recompute_with_one_line(
        profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    assert main(["partition", str(profile_csv), "--stages", "2", "--checkpoint", "always",
                 "--out", str(old)]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "autopipe: --checkpoint is now --recompute; --checkpoint will be removed in the next release"]
    assert main(["partition", str(profile_csv), "--stages", "2", "--recompute", "always",
                 "--out", str(new)]) == 0
    assert capsys.readouterr().err == ""
    assert Plan.load(old).recompute == Plan.load(new).recompute == "always"
    assert Plan.load(old).stages == Plan.load(new).stages


def test_existing_out_is_left_unchanged(profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    out.write_text("precious")
    assert main(["partition", str(profile_csv), "--stages", "2", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_text() == "precious"
    assert main(["partition", str(profile_csv), "--stages", "2", "--out", str(out), "--force"]) == 0
    assert Plan.load(out).num_stages == 2


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--stages", "13"], "stages=13 > 12 layers"),
        (["--stages", "2", "--memory", "1KiB"], r"layer '\S+' alone needs .* more than the 1.0 KiB limit, so no split fits; .* \(--memory / memory_limit=\)"),
        (["--stages", "2", "--method", "nope"], "method='nope'"),
    ],
)
def test_bad_input(profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                   extra: list[str], match: str) -> None:
    out = tmp_path / "p.json"
    assert main(["partition", str(profile_csv), *extra, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autopipe: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(match, err)
    assert not out.exists()


def test_corrupt_profile(profile_csv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile_csv.write_text("layer,fwd_ms\n\"broken")
    assert main(["partition", str(profile_csv), "--stages", "2", "--out", str(tmp_path / "p.json")]) == 2
    assert "toy.csv" in capsys.readouterr().err


def test_simulate_corrupt_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert main(["simulate", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_partition_names_devices_and_chunks_like_train(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = random_chain(6, 3)
    bare = prof.save(tmp_path / "bare")  # no device kind, no chunks recorded
    prof.meta.update(device="cpu", device_type="cpu", chunks=2)
    cpu = prof.save(tmp_path / "cpu")
    assert main(["partition", str(bare), "--stages", "2", "--out", str(tmp_path / "a.json")]) == 0
    assert Plan.load(tmp_path / "a.json").chunks == 4  # the one default of every command
    assert main(["partition", str(cpu), "--stages", "2", "--out", str(tmp_path / "b.json")]) == 0
    rows = capsys.readouterr().out.split("wrote " + str(tmp_path / "a.json"))[1].splitlines()
    assert [r.split()[:2] for r in rows[2:4]] == [["0", "cpu:0"], ["1", "cpu:1"]]
    assert Plan.load(tmp_path / "b.json").chunks == 2  # the profile's


def test_simulate_and_plot_default_to_the_plans_schedule(tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    profile_csv = random_chain(12).save(tmp_path / "chain.csv")
    out = tmp_path / "plan.json"
    assert main(["partition", str(profile_csv), "--stages", "2", "--chunks", "4", "--schedule",
                 "1f1b", "--out", str(out)]) == 0
    capsys.readouterr()
    assert main(["simulate", str(out)]) == 0
    assert capsys.readouterr().out.startswith("schedule 1f1b:")
    assert main(["simulate", str(out), "--schedule", "gpipe"]) == 0
    assert capsys.readouterr().out.startswith("schedule gpipe:")


def test_partition_with_replicas(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prof = random_chain(12, 5)
    prof.meta.update(micro_batch_size=2, batch_size=16, chunks=4)
    csv = prof.save(tmp_path / "profiles" / "replicas")
    out = tmp_path / "replicas.json"
    assert main(["partition", str(csv), "--devices", "4", "--data-parallel", "auto", "--dp-mode",
                 "fsdp", "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.data_parallel * plan.num_stages == 4 and plan.dp_mode == "fsdp"
    assert "| replicas | stages |" in capsys.readouterr().out
    for extra, match in ((["--data-parallel", "3"], "data_parallel=3 does not divide the 4 devices"),
                         (["--data-parallel", "two"], "--data-parallel 'two': give a whole number"),
                         (["--data-parallel", "2", "--dp-mode", "zero"], "dp_mode='zero': choose one of")):
        assert main(["partition", str(csv), "--devices", "4", *extra, "--out",
                     str(tmp_path / "bad.json")]) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1, err
