"""Experiments from a config: loading the file (`config_file`), its keys (`keys`), the
sections that build a session (`sections`), the same-run check of a resume
(`same_run`), and building and running it (`run`, which loads JAX: import it where it
is used, so that a config's error is found and said without loading JAX)."""

from jaxmon._base.errors import ConfigError
from jaxmon._experiment.config_file import apply_overrides, load_config

__all__ = ["ConfigError", "apply_overrides", "load_config"]
