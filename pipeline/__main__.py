"""``python -m pipeline ...``: the pipeline's command line (see :mod:`pipeline.cli`)."""

from __future__ import annotations

from pipeline.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
