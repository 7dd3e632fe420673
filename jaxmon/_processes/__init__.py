"""Several JAX processes: agreement, stragglers, and launching them."""
