"""`python -m jaxmon`: the `jaxmon` command."""

from jaxmon._cli.main import run

run()
