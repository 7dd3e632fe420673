"""configs/lm.py on a data x fsdp mesh: the parameters and their optimizer state split
over the `fsdp` axis (fully sharded data parallelism), each batch over every device.

Run on 8 simulated CPU devices (or on a host with 8 GPUs, without XLA_FLAGS):
  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
    jaxmon train --config configs/lm_fsdp.py --workdir runs/lm_fsdp
As two processes of 4 devices each, connected as two hosts would be:
  XLA_FLAGS=--xla_force_host_platform_device_count=4 \\
    jaxmon train --config configs/lm_fsdp.py --workdir runs/lm_fsdp2 --processes 2
On one GPU: --config.mesh.fsdp=1. See what it will do first: `jaxmon check --config configs/lm_fsdp.py`.
"""

import lm  # configs/lm.py, beside this file


def get_config() -> dict:
    config = lm.get_config()
    config["name"] = "char-lm-fsdp"
    config["mesh"] = {"data": -1, "fsdp": 4}  # -1: the devices left (8 devices: data=2, fsdp=4)
    config["sharding"] = {
        # The model's logical axes (nn.with_logical_partitioning) on mesh axes, first match first:
        # jaxmon.models.TRANSFORMER_RULES without a tensor axis. Optimizer state follows its parameter.
        "rules": [["batch", ["data", "fsdp"]], ["embed", "fsdp"], ["vocab", None], ["mlp", None],
                  ["heads", None], ["length", None], ["kv", None], ["layers", None]],
        "fsdp": None,  # or a mesh axis: split every parameter the rules leave whole on its largest dimension
        "batch": ["data", "fsdp"],  # a batch's rows over every device
    }
    return config
