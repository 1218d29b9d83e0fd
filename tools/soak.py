#!/usr/bin/env python3
"""The memory-leak soak tool: `python3 tools/soak.py --minutes 10 [--inject-leak]`.

The same as `rocmforge-raw soak` (the workload and judgement live in rocmforge_raw.soak, so
the installed console script runs it too). Exit 0 on PASS, 1 on FAIL, 2 not judged (memory
never settled: run longer). Its progress goes to stderr: a bar on a terminal, elsewhere a
line every 10 s (RF_PROGRESS_EVERY sets the seconds) such as
``soak host:0: 35/60 s, 1234 cycles, RSS +0.3 MiB``.
"""

import sys

from rocmforge_raw.cli.main import main

if __name__ == "__main__":
    sys.exit(main(["soak", *sys.argv[1:]]))
