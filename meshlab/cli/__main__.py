"""``python -m meshlab.cli``: the ``meshlab`` command."""

from . import main

raise SystemExit(main())
