"""The device-sheet flags: ``profile --estimate SHEET`` and the ``calibrate`` command's config.

    EstimateFlags    --estimate: estimate the layers on a device sheet instead of measuring them
                     (profile; [Note: counted, not timed])
    CalibrateConfig  autopipe calibrate: this device measured into a sheet ([Note: calibrated
                     sheets])

Checked when made ([Note: flags checked when made] in flag_groups.py): a sheet that does not
load is one line naming the flag before any model is built. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopipe.app.flag_groups import Checked, HostAllocator, check_choice, check_count, flag
from autopipe.core.device_sheet import load_sheet, shipped_sheets
from autopipe.errors import BuildError, ProfileError

__all__ = ["EstimateFlags", "CalibrateConfig"]


@dataclass(frozen=True, kw_only=True)
class EstimateFlags(Checked):
    estimate: str | None = flag(
        None, f"estimate the layers on a device sheet instead of measuring them: a shipped one "
              f"({', '.join(shipped_sheets())}) or a FILE.json (autopipe calibrate writes one); FLOPs "
              f"and bytes counted with the model built on the meta device, nothing timed", metavar="SHEET")

    def _check(self) -> None:
        if self.estimate is not None:
            try:
                load_sheet(self.estimate)
            except ProfileError as err:
                raise BuildError(f"--estimate {self.estimate}: {err}") from None


@dataclass(frozen=True)
class CalibrateConfig(Checked):
    device: str = flag("cpu", "cpu | cuda | cuda:N: the device to measure (default cpu)")
    out: str | None = flag(None, "the sheet's FILE.json (default sheets/NAME.json)")
    name: str | None = flag(None, "the sheet's name (default DEVICE-calibrated)")
    force: bool = flag(False, "overwrite --out if it exists")
    repeats: int = flag(5, "timed runs of each measured shape; the sheet takes the median (default 5)")
    threads: int | None = flag(None, "torch CPU threads while measuring; estimates on the sheet hold for "
                                     "profiles measured with as many (default: torch's)")
    host_allocator: HostAllocator = flag(
        "retain", "on a CPU, retain: glibc keeps freed memory for reuse, as autopipe profile does "
                  "(default); system: the allocator as it is")

    def _check(self) -> None:
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise BuildError(f"--device {self.device}: calibrate measures a cpu or a cuda device, not "
                             f"{self.device!r}; pass --device cpu or cuda:N")
        check_count("--repeats", self.repeats)
        check_count("--threads", self.threads)
        check_choice("--host-allocator", self.host_allocator, HostAllocator)
