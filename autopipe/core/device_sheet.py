"""Device sheets: what a device can do, for profiles estimated instead of measured. Torch-free.

    sheet = load_sheet("h100")                       # a shipped sheet, or a sheet file's path
    sheet.op_ms("matmul", "bf16", flops=2 * m * n * k, nbytes=2 * (m * k + k * n + m * n))

A sheet is a JSON object (``autopipe/core/sheets/NAME.json`` for the shipped ones, any file for a
user's own; ``autopipe calibrate`` writes one for the device it runs on) of these fields, every
one required:

    name, device              the sheet's short name and the device in words
    device_type               torch's device type: cuda (NVIDIA and ROCm GPUs) or cpu
    peak_flops_bf16/_fp16/_fp32   dense peak FLOP/s in each compute dtype (no sparsity)
    memory_bandwidth          device memory (HBM) bytes/s
    memory_bytes              device memory, bytes
    intra_host_bandwidth      bytes/s one way between two devices of one host (NVLink, ...)
    inter_host_bandwidth      bytes/s one way per device between hosts (its share of the NICs)
    efficiency_matmul, efficiency_attention, efficiency_elementwise
                              the fraction of the roofline each class of op reaches, in (0, 1]
    launch_us                 the least one op (one kernel) takes, microseconds

and optionally ``sources``, field -> where its number comes from (JSON has no comments; every
shipped sheet names a source for every number), and ``format`` (``autopipe-device-sheet/1``).

[Note: roofline] An op of class c (matmul, attention, elementwise) that does ``flops`` in a
compute dtype and moves ``nbytes`` to and from device memory takes
``max(flops / peak_flops[dtype], nbytes / memory_bandwidth) / efficiency[c] + launch``: the
roofline of the device, at the fraction of it that class of op reaches, and never less than
what launching it costs. This is the one place an op's time is estimated:
autopipe/frontend/profiling/estimated/ counts each op's FLOPs and bytes and sums this over a
layer's ops; ``autopipe calibrate`` fits the efficiencies and the launch floor to measured ops
through the same counting and this same formula.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from autopipe.core.atomic_files import atomic_write_text
from autopipe.errors import ProfileError

__all__ = ["SHEET_FORMAT", "OP_CLASSES", "COMPUTE_DTYPES", "NUMBERS", "DeviceSheet", "load_sheet",
           "shipped_sheets", "SHEETS_DIR"]

SHEET_FORMAT = "autopipe-device-sheet/1"
OP_CLASSES: tuple[str, ...] = ("matmul", "attention", "elementwise")
COMPUTE_DTYPES: tuple[str, ...] = ("bf16", "fp16", "fp32")
SHEETS_DIR = Path(__file__).resolve().parent / "sheets"
TEXTS: tuple[str, ...] = ("name", "device", "device_type")
DEVICE_TYPES: tuple[str, ...] = ("cuda", "cpu")
NUMBERS: tuple[str, ...] = (
    "peak_flops_bf16", "peak_flops_fp16", "peak_flops_fp32", "memory_bandwidth", "memory_bytes",
    "intra_host_bandwidth", "inter_host_bandwidth", "efficiency_matmul", "efficiency_attention",
    "efficiency_elementwise", "launch_us",
)
_OPTIONAL = ("sources", "format")
_FIX = "fix the sheet (autopipe/core/device_sheet.py lists its fields) or write one with autopipe calibrate"


@dataclass(frozen=True)
class DeviceSheet:
    """What one device can do ([Note: roofline]); checked when made, one ProfileError line."""

    name: str
    device: str
    device_type: str
    peak_flops_bf16: float
    peak_flops_fp16: float
    peak_flops_fp32: float
    memory_bandwidth: float
    memory_bytes: int
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    efficiency_matmul: float
    efficiency_attention: float
    efficiency_elementwise: float
    launch_us: float
    sources: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = f"device sheet {self.name!r}"
        for key in TEXTS:
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ProfileError(f"{where}: field {key!r} must be a non-empty string, got "
                                   f"{getattr(self, key)!r}; {_FIX}")
        if self.device_type not in DEVICE_TYPES:
            raise ProfileError(f"{where}: field 'device_type' must be one of {list(DEVICE_TYPES)}, got "
                               f"{self.device_type!r}; {_FIX}")
        for key in NUMBERS:
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise ProfileError(f"{where}: field {key!r} must be a number, got {value!r}; {_FIX}")
            if value <= 0 or (key.startswith("efficiency_") and value > 1):
                wanted = "in (0, 1]" if key.startswith("efficiency_") else "> 0"
                raise ProfileError(f"{where}: field {key!r} must be {wanted}, got {value!r}; {_FIX}")
        if not isinstance(self.sources, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.sources.items()):
            raise ProfileError(f"{where}: 'sources' must map field names to text; {_FIX}")
        unknown = sorted(set(self.sources) - set(NUMBERS) - set(TEXTS))
        if unknown:
            raise ProfileError(f"{where}: 'sources' names unknown field {unknown[0]!r} (fields: "
                               f"{list(NUMBERS)}); {_FIX}")

    # --- the roofline -----------------------------------------------------------------------
    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s in ``dtype`` (bf16, fp16, fp32); any other dtype (integers, fp64)
        is charged at fp32's."""
        return float(getattr(self, f"peak_flops_{dtype if dtype in COMPUTE_DTYPES else 'fp32'}"))

    def efficiency(self, op_class: str) -> float:
        if op_class not in OP_CLASSES:
            raise ProfileError(f"op class {op_class!r} is unknown; use one of {list(OP_CLASSES)}")
        return float(getattr(self, f"efficiency_{op_class}"))

    def op_ms(self, op_class: str, dtype: str, flops: float, nbytes: float) -> float:
        """One op's estimated milliseconds ([Note: roofline])."""
        seconds = max(flops / self.peak_flops(dtype), nbytes / self.memory_bandwidth)
        return 1e3 * seconds / self.efficiency(op_class) + self.launch_us / 1e3

    # --- JSON -------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": SHEET_FORMAT}
        data.update({f.name: getattr(self, f.name) for f in fields(self)})
        data["sources"] = dict(self.sources)
        return data

    @classmethod
    def from_json(cls, data: Any, where: str) -> DeviceSheet:
        """From a sheet's JSON object; a missing, unknown or non-numeric field is one line
        naming it."""
        if not isinstance(data, Mapping):
            raise ProfileError(f"{where} must hold a JSON object of the sheet's fields, got "
                               f"{type(data).__name__}; {_FIX}")
        for key in (*TEXTS, *NUMBERS):
            if key not in data:
                raise ProfileError(f"{where} lacks field {key!r} (a sheet needs {list(TEXTS + NUMBERS)}); {_FIX}")
        unknown = sorted(set(data) - set(TEXTS) - set(NUMBERS) - set(_OPTIONAL))
        if unknown:
            raise ProfileError(f"{where} has unknown field {unknown[0]!r} (a sheet takes "
                               f"{list(TEXTS + NUMBERS + _OPTIONAL)}); {_FIX}")
        if data.get("format", SHEET_FORMAT) != SHEET_FORMAT:
            raise ProfileError(f"{where} is format {data['format']!r}, not {SHEET_FORMAT!r}; {_FIX}")
        for key in NUMBERS:  # one line naming the field, before the dataclass checks the rest
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ProfileError(f"{where}: field {key!r} must be a number, got {value!r}; {_FIX}")
        values = {key: data[key] for key in (*TEXTS, *NUMBERS)}
        values["memory_bytes"] = int(values["memory_bytes"])
        try:
            return cls(**values, sources=dict(data.get("sources") or {}))
        except ProfileError as err:
            raise ProfileError(str(err).replace(f"device sheet {data['name']!r}", where, 1)) from None

    def save(self, path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the sheet as JSON; refuses to replace a file unless ``overwrite=True``."""
        p = Path(path)
        if p.exists() and not overwrite:
            raise ProfileError(f"{p} already exists: refusing to overwrite a device sheet; pass --force / "
                               "overwrite=True or choose another --out")
        atomic_write_text(p, json.dumps(self.to_json(), indent=2) + "\n")
        return p


def shipped_sheets() -> list[str]:
    """The names of the sheets autopipe ships (``autopipe/core/sheets/NAME.json``)."""
    return sorted(p.stem for p in SHEETS_DIR.glob("*.json"))


def _is_path(text: str) -> bool:
    return text.endswith(".json") or os.sep in text or "/" in text or Path(text).is_file()


def load_sheet(sheet: str | os.PathLike[str] | DeviceSheet) -> DeviceSheet:
    """A shipped sheet by name (``"h100"``), a sheet file by path, or ``sheet`` itself."""
    if isinstance(sheet, DeviceSheet):
        return sheet
    if not isinstance(sheet, str | os.PathLike):
        raise ProfileError(f"estimate= takes a device sheet's name or a sheet file's path, got "
                           f"{type(sheet).__name__}; shipped sheets: {shipped_sheets()}")
    text = os.fspath(sheet)
    if not _is_path(text):
        path = SHEETS_DIR / f"{text.lower()}.json"
        if not path.is_file():
            raise ProfileError(f"no device sheet {text!r}: shipped sheets are {shipped_sheets()}; or give a "
                               "sheet file's path (autopipe calibrate --device DEV --out FILE.json writes one)")
        where = f"shipped device sheet {path.name}"
    else:
        path = Path(text)
        if not path.is_file():
            raise ProfileError(f"device sheet file {text} does not exist; shipped sheets are "
                               f"{shipped_sheets()}, or write one with autopipe calibrate")
        where = f"device sheet {path}"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ProfileError(f"{where} is not valid JSON (line {err.lineno}): {err.msg}; {_FIX}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ProfileError(f"{where} cannot be read ({type(err).__name__}); {_FIX}") from None
    return DeviceSheet.from_json(data, where)
