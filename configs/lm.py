"""A character-level language model: a small causal transformer on Python's own sources.

Run: `jaxmon train --config configs/lm.py --workdir runs/lm`
Override any value: `--config.model.num_layers=4`,
`--config.optimizer.learning_rate.peak_value=3e-3`; for more steps, the schedule's too:
`--config.steps=600 --config.optimizer.learning_rate.decay_steps=600`.

The text is a few standard-library modules' sources (`jaxmon.datasets:python_text`,
nothing downloaded), packed into rows of `seq_len + 1` byte tokens. The "lm" task trains
on the next-token cross-entropy; its eval loss is in nats per character, which a model
that ignores context cannot bring below the characters' unigram entropy (~3.08 nats on
the test split). Expect ~2.08 after these 200 steps: under a minute on a 2-core CPU.
"""


def get_config() -> dict:
    seq_len = 64  # characters per row: the context the model sees
    steps = 200
    return {
        "name": "char-lm",
        "seed": 0,
        "prng_impl": "rbg",  # the fresh state's random values: "rbg", "threefry2x32" or "unsafe_rbg" (docs/cli.md)
        "steps": steps,  # the last step (StopAtStepHook)
        "data": {
            "source": "jaxmon.datasets:python_text",  # fn(split, **rest) -> {"x", "y"}: int32 (N, seq_len)
            "batch_size": 16,  # rows per step
            "seq_len": seq_len,
            "test_fraction": 0.1,  # the end of the text, never trained on
            "pad_id": 0,  # the id python_text pads its last row with: no loss there (None: every id is a token)
            "eval_split": "test",
            "eval_batch_size": 512,  # rows per eval batch: the whole test split (~330 rows) in one, one compilation
        },
        "model": {
            "name": "jaxmon.models:Transformer",  # decoder-only, pre-norm, learned positions
            "vocab_size": 128,  # jaxmon.datasets.PYTHON_TEXT_VOCAB: ASCII, 0 is data.pad_id
            "max_len": seq_len,
            "num_layers": 2,
            "num_heads": 4,
            "embed_dim": 64,
            "mlp_dim": 256,
            "dtype": "float32",  # the computation's dtype: "bfloat16" on a GPU or TPU (softmax, logits: float32)
            "param_dtype": "float32",  # the parameters' dtype (the optimizer keeps its state in it)
        },
        "task": "lm",  # next-token cross-entropy, data.pad_id masked; eval loss = sum of losses / tokens
        "optimizer": {
            "name": "adamw",
            "learning_rate": {"name": "warmup_cosine_decay_schedule", "init_value": 0.0, "peak_value": 5e-3,
                              "warmup_steps": 20, "decay_steps": steps},  # linear warm-up, then cosine to 0
            "weight_decay": 0.01,
            "weight_decay_mask": "matrices",  # kernels and embeddings, not biases or norm scales ("all": every one)
            "clip_global_norm": 1.0,  # clip the gradients' global norm first (None: no clipping)
            "accumulate_steps": 1,  # each step's batch as N micro-batches: one update of their mean gradient
        },
        "hooks": [
            {"name": "ProgressBarHook", "fetches": ["loss"]},  # chief_only by default
            {"name": "EvalHook", "every_n_steps": 100},  # eval/loss, eval/perplexity, eval/accuracy on the test split
            # A NaN, or a loss 10x its running average (from step 1: 10x the first loss), stops the run
            # (on_nan="rollback" goes back to the newest checkpoint instead); checked at least every 10 steps.
            {"name": "NanHook", "spike_factor": 10.0, "every_n_steps": 10},
        ],
        "session": {  # MonitoredTrainingSession's arguments (None turns a setting off)
            "save_checkpoint_steps": 100,
            "save_checkpoint_secs": None,  # or every N seconds (then save_checkpoint_steps=None)
            "save_summaries_steps": 25,
            "save_summaries_secs": None,
            "log_step_count_steps": 100,
            "max_to_keep": 2,
            "steps_per_dispatch": 1,  # up to N steps per dispatch (a lax.scan): docs/performance.md says when it helps
        },
        "mesh": None,  # one device; e.g. {"data": -1, "fsdp": 1, "tensor": 1} on several
        # With a mesh, the model's logical axes map onto it as jaxmon.models.TRANSFORMER_RULES does:
        # {"rules": [["batch", ["data", "fsdp"]], ["embed", "fsdp"], ["vocab", "tensor"], ["mlp", "tensor"],
        #            ["heads", "tensor"], ["length", None], ["kv", None]]}
        "sharding": None,
        # perf/* summaries: steps, examples and tokens per second, TFLOP/s per device and MFU. None: jaxmon's figure
        # (a step's FLOPs: the Transformer's model count, 6N + 12·L·T·d a token; examples: data.batch_size rows;
        # tokens: theirs; the peak: jaxmon's table by the device's kind); a number takes its place
        "perf": {"every_n_steps": 100, "peak_tflops": None, "flops_per_step": None, "examples_per_step": None,
                 "tokens_per_step": None},
    }
