"""Settings of the default example that `make train` runs (examples/default.py)."""


def get_config() -> dict:
    return {
        "steps": 2000,  # StopAtStepHook(last_step=steps)
        "batch_size": 128,
        "learning_rate": 3e-3,  # Adam
        "hidden": 64,  # width of the two tanh layers
        "log_every": 250,  # fetch and print the loss every this many steps
        "seed": 0,
    }
