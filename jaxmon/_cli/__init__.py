"""The `jaxmon` command."""
