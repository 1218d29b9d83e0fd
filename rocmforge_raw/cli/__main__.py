"""``python -m rocmforge_raw.cli``: the ``rocmforge-raw`` command."""

import sys

from .main import main

sys.exit(main())
