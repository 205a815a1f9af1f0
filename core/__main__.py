"""``python -m clusterwire``: the clusterwire command line."""

from clusterwire.cli import main

raise SystemExit(main())
