"""`python -m jaxmon`: the `jaxmon` command."""

from jaxmon._cli import run

run()
