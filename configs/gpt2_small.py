"""configs/lm.py at GPT-2 small's shape, for a GPU or TPU: 12 layers of 768 (12 heads, an
MLP of 3072), sequences of 1024 byte tokens, 32 rows a step, bfloat16 compute on float32
parameters. With the byte vocabulary (128) it has about 86M parameters (GPT-2's own
50257-token vocabulary would add 38M in its embedding). Its blocks run as one in a
`lax.scan` (`model.scan_layers`), so XLA compiles and initialises one block, not twelve
(`docs/cli.md`, "The fresh state").

Run: `jaxmon train --config configs/gpt2_small.py --workdir runs/gpt2_small`; the log's
`perf` lines give tokens per second and MFU (`docs/cli.md`, "Throughput and MFU"), its
start-up line the time to the first step. `jaxmon check --config configs/gpt2_small.py`
shows its parameters, memory and compile time first. On a CPU, a step takes seconds.
"""

import lm  # configs/lm.py, beside this file


def get_config() -> dict:
    config = lm.get_config()
    seq_len, steps = 1024, 2000
    config["name"] = "gpt2-small-bytes"
    config["steps"] = steps
    config["data"].update({"seq_len": seq_len, "batch_size": 32, "eval_batch_size": 32})
    config["model"].update({"max_len": seq_len, "num_layers": 12, "num_heads": 12, "embed_dim": 768,
                            "mlp_dim": 3072, "dtype": "bfloat16", "param_dtype": "float32",
                            "logits_dtype": "bfloat16",  # the loss works in float32 from them, keeping none
                            "scan_layers": True})  # one block compiled and initialised for all 12
    config["optimizer"]["learning_rate"].update({"peak_value": 6e-4, "warmup_steps": 100, "decay_steps": steps})
    config["session"].update({"save_checkpoint_steps": 500, "save_summaries_steps": 50})
    config["hooks"][1]["every_n_steps"] = 500  # EvalHook
    config["perf"]["every_n_steps"] = 50
    return config
