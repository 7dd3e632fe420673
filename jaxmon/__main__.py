"""`python -m jaxmon`: the `jaxmon` command."""

import sys

from jaxmon._cli import main

sys.exit(main())
