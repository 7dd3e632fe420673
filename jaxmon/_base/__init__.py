"""The values every part shares: the hook protocol, triggers, errors and pytree paths."""
