"""Several JAX processes: agreement, stragglers, launching them, and the watchdog that ends a hung one."""
