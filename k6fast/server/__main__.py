"""`python -m k6fast.server --model M ...`: the same as `k6fast serve`."""

import sys

from .cli import main

sys.exit(main())
