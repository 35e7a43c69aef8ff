"""Write benchmarks/results/INDEX.md (the code: src/ctxrelay/results_index.py, standard library only).

    python scripts/results_index.py           rewrite the index
    python scripts/results_index.py --check   exit 1 if the index is stale, misses a file, or SUPERSEDES.md
                                              names a file that does not exist
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from ctxrelay.results_index import *  # noqa: E402,F403  (the test loads this file and calls problems/render)
from ctxrelay.results_index import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
