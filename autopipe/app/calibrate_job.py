"""The ``autopipe calibrate`` command as one library call: this device measured into a sheet.

    sheet, path = calibrate_to_file(CalibrateConfig(device="cpu", threads=1))
    print(sheet_summary(sheet))
"""

from __future__ import annotations

from pathlib import Path

import torch

from autopipe.app.sheet_flags import CalibrateConfig
from autopipe.core.device_sheet import NUMBERS, DeviceSheet
from autopipe.core.units import format_bytes
from autopipe.errors import ProfileError
from autopipe.frontend.profiling.estimated.calibrate import calibrate
from executor.host_allocator import use_host_allocator

__all__ = ["calibrate_to_file", "sheet_summary"]


def calibrate_to_file(config: CalibrateConfig) -> tuple[DeviceSheet, Path]:
    """Measure ``config.device`` ([Note: calibrated sheets]) and save its sheet; an existing file
    is refused before anything is measured unless ``config.force``."""
    name = config.name or f"{torch.device(config.device).type}-calibrated"
    out = Path(config.out) if config.out is not None else Path("sheets") / f"{name}.json"
    if out.exists() and not config.force:
        raise ProfileError(f"{out} already exists: refusing to overwrite a device sheet; pass --force or "
                           "choose another --out")
    before = torch.get_num_threads()
    try:
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        if torch.device(config.device).type == "cpu":
            use_host_allocator(config.host_allocator)
        sheet = calibrate(config.device, name=name, repeats=config.repeats)
    finally:
        torch.set_num_threads(before)
    out.parent.mkdir(parents=True, exist_ok=True)
    return sheet, sheet.save(out, overwrite=config.force)


def sheet_summary(sheet: DeviceSheet) -> str:
    """Every number of the sheet, one line each, in units a person reads."""
    def shown(key: str) -> str:
        value = float(getattr(sheet, key))
        if key.startswith("peak_flops"):
            return f"{value / 1e12:.3f} TFLOP/s"
        if key.endswith("bandwidth"):
            return f"{format_bytes(value)}/s"
        if key == "memory_bytes":
            return format_bytes(value)
        return f"{value:.2f} us" if key == "launch_us" else f"{value:.3f}"

    width = max(len(k) for k in NUMBERS)
    return "\n".join([f"device sheet {sheet.name!r}: {sheet.device} ({sheet.device_type})",
                      *(f"  {k:<{width}} {shown(k)}" for k in NUMBERS)])
