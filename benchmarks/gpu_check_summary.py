"""The one table benchmarks/gpu_check.sh ends with, read from the files its steps wrote.

    python3 benchmarks/gpu_check_summary.py OUT_DIR [--dry-run]

One row per step (from OUT_DIR/steps.tsv: name, exit status, seconds, log), its result read
off what the step wrote: pytest's closing line, each CUDA profile's layers, times and peak
memory (its JSON), the measured / predicted ratios of executor_vs_prediction.py's table, and
giant.py's layer-by-layer profile row with its peak. Exits 1 when a step failed or timed out.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

STATUS = {"0": "ok", "124": "timed out", "137": "killed (time)"}


def _format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _last_line(text: str, pattern: str) -> str:
    lines = [line.strip("= ") for line in text.splitlines() if re.search(pattern, line)]
    return lines[-1] if lines else ""


def tests_result(text: str) -> str:
    return _last_line(text, r"\d+ (passed|failed|skipped|tests? collected|error)") or "no result"


def profile_result(csv: Path) -> str:
    meta_file = csv.with_suffix(".json")
    if not meta_file.exists():
        return "no profile written"
    meta = json.loads(meta_file.read_text())["meta"]
    rows = csv.read_text().splitlines()[1:]
    header = csv.read_text().splitlines()[0].split(",")
    fwd = sum(float(r.split(",")[header.index("fwd_ms")] or 0) for r in rows)
    bwd = sum(float(r.split(",")[header.index("bwd_ms")] or 0) for r in rows)
    peak = meta.get("peak_memory_bytes")
    return (f"{len(rows)} layers, fwd {fwd:.3f} + bwd {bwd:.3f} ms / micro-batch of "
            f"{meta.get('micro_batch_size')}, {meta.get('mode')} on {meta.get('device')}, peak "
            f"{_format_bytes(peak) if peak is not None else 'n/a'}")


def prediction_result(text: str) -> str:
    header: list[str] = []
    ratios: list[float] = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if "measured / predicted" in cells:
            header = cells
        elif header and len(cells) == len(header) and not cells[0].startswith("-"):
            try:
                ratios.append(float(cells[header.index("measured / predicted")]))
            except ValueError:
                pass
    if not ratios:
        return "no table"
    return (f"{len(ratios)} plans: measured / predicted {min(ratios):.2f}-{max(ratios):.2f}, "
            f"median {statistics.median(ratios):.2f}")


def giant_result(text: str) -> str:
    row = _last_line(text, r"^\| profile \(layer by layer\)")
    head = _last_line(text, r"^HF Llama")
    if not row:
        return "no profile row"
    cells = [c.strip() for c in row.strip("|").split("|")]
    return f"{head.split(':')[0]}: {cells[1]} s, {cells[3]}" if len(cells) >= 4 else row


def main(argv: Sequence[str]) -> int:
    out = Path(argv[0])
    mode = argv[1] if len(argv) > 1 else "run"
    steps = [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines() if line]
    lines = [f"gpu_check{' --dry-run' if mode == '--dry-run' else ''}: {out}", "",
             "| step | status | seconds | result |", "|---|---|---:|---|"]
    failed = False
    for name, rc, seconds, log in steps:
        text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
        if name == "CUDA tests":
            result = tests_result(text)
        elif name.startswith("profile "):
            result = profile_result(out / "profiles" / "cuda" / f"{name.split()[1]}.csv")
        elif name.startswith("measured vs predicted"):
            result = prediction_result(text)
        elif name.startswith("Llama"):
            result = giant_result(text)
        else:
            result = " ".join(text.split("\n")[:2]).strip()
        if rc != "0":
            failed = True
            tail = [t for t in text.splitlines() if t.strip()]
            result = f"{result}; last line: {tail[-1][:160] if tail else 'none'}"
        lines.append(f"| {name} | {STATUS.get(rc, f'exit {rc}')} | {seconds} | "
                     f"{result.replace('|', '/')} |")
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
