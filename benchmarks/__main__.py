"""`python -m kvdepot.bench [flags]`: the same program as `kvdepot bench`."""

import sys

from kvdepot.bench.cli import main

sys.exit(main())
