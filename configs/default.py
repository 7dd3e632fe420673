"""The default experiment (`make train`): a small CNN on the UCI hand-written digits.

Run: `jaxmon train --config configs/default.py --workdir runs/default`
Override any value: `--config.optimizer.learning_rate=1e-3`, `--config.steps=500`,
`--config.hooks.1.every_n_steps=100`.
"""


def get_config() -> dict:
    return {
        "name": "digits-cnn",
        "seed": 0,
        "prng_impl": "rbg",  # the fresh state's random values: "rbg", "threefry2x32" or "unsafe_rbg" (docs/cli.md)
        "steps": 1500,  # the last step (StopAtStepHook)
        "data": {
            "source": "jaxmon.datasets:digits",  # fn(split, **rest) -> {"x", "y"}
            "batch_size": 64,
            "eval_split": "test",  # 20% of the 1797 images, never trained on
            "test_fraction": 0.2,
            "loader": "arrays",  # or "grain": a grain pipeline with worker processes (pip install 'jaxmon[grain]')
            "worker_count": 2,  # grain's worker processes (data.loader "grain" only)
        },
        "model": {"name": "jaxmon.models:CNN", "channels": [16, 32], "features": [64], "num_outputs": 10},
        "task": "classification",  # softmax cross-entropy, accuracy
        "optimizer": {"name": "adam", "learning_rate": 2e-3},
        "hooks": [
            {"name": "ProgressBarHook", "fetches": ["loss", "accuracy"]},  # chief_only by default
            {"name": "EvalHook", "every_n_steps": 250},  # eval/loss, eval/accuracy on the test split
            {"name": "NanHook"},
        ],
        "session": {  # MonitoredTrainingSession's arguments (None turns a setting off)
            "save_checkpoint_steps": 500,
            "save_checkpoint_secs": None,  # or every N seconds (then save_checkpoint_steps=None)
            "save_summaries_steps": 50,
            "save_summaries_secs": None,
            "log_step_count_steps": 250,
            "max_to_keep": 3,
            "steps_per_dispatch": 1,  # up to N steps per dispatch (a lax.scan): docs/performance.md says when it helps
            "scan_unroll": "auto",  # how that scan compiles: "auto", an unroll int (1: a loop) or True (fully)
        },
        "warm_start": None,  # a checkpoint directory to take the model's parameters from, on a fresh start
        # perf/* summaries; None: jaxmon's figure (FLOPs: XLA's count of the step; the peak: by the device's kind)
        "perf": {"every_n_steps": 250, "peak_tflops": None, "flops_per_step": None, "examples_per_step": None,
                 "tokens_per_step": None},
    }
