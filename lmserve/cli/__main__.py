"""`python -m lmserve.cli`: the same as the `lmserve` command."""

import sys

from lmserve.cli import main

sys.exit(main())
