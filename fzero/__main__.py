"""`python -m fzero ...`: the same as the `fzero` command."""

import sys

from fzero._src.cli import main

sys.exit(main())
