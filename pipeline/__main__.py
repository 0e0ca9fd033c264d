"""``python -m pipeline ...``: the pipeline's command line (see :mod:`pipeline.commands`)."""

from __future__ import annotations

from pipeline.commands import main

if __name__ == "__main__":
    raise SystemExit(main())
