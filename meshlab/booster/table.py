"""``python -m meshlab.booster.table docs/booster.md``: rewrite the page's generated
argument table (see ``_table``)."""

import sys

from ._table import rewrite

if __name__ == "__main__":
    print("rewritten" if rewrite(sys.argv[1]) else "up to date")
