"""The device-sheet flags: ``profile --estimate SHEET``.

    EstimateFlags    --estimate: estimate the layers on a device sheet instead of measuring them
                     (profile; [Note: counted, not timed])

Checked when made ([Note: flags checked when made] in flag_groups.py): a sheet that does not
load is one line naming the flag before any model is built. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopipe.app.flag_groups import Checked, flag
from autopipe.core.device_sheet import load_sheet, shipped_sheets
from autopipe.errors import BuildError, ProfileError

__all__ = ["EstimateFlags"]


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
