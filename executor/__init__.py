"""executor: the GPipe runtime. Knows stages, devices and micro-batches; never the planner.

Imports torch only (never ``autopipe``), so it can be used with hand-made stages.
"""

from __future__ import annotations

__all__: list[str] = []
