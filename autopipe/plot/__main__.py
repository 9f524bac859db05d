"""``python -m autopipe.plot --readme-images``: regenerate docs/img/*.png (autopipe.plot.readme)."""

from __future__ import annotations

from autopipe.plot.readme import main

__all__: list[str] = []

if __name__ == "__main__":
    raise SystemExit(main())
