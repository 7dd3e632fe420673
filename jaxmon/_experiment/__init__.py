"""Experiments from a config: loading the file (`config_file`), its keys (`keys`), the
sections that build a session (`sections`), the same-run check of a resume
(`same_run`), and building and running it (`run`)."""

from jaxmon._experiment.config_file import ConfigError, apply_overrides, load_config
from jaxmon._experiment.run import train_experiment, use_compilation_cache

__all__ = ["ConfigError", "apply_overrides", "load_config", "train_experiment", "use_compilation_cache"]
