"""Load time and host memory of `model.init: hf:<dir>`.

Writes a ~1.2B-parameter Llama checkpoint (Llama 3.2 1B's shapes, bf16, safetensors in
~1 GB shards) with random weights, then loads it on 8 fake CPU devices with mesh.fsdp=8
and prints the load time, the peak resident memory during the load and the resident
memory after it. No second copy of the model means the peak exceeds the after-load figure
by no more than about twice the largest tensor (in float32).

    python benchmarks/hf_load.py [--dir /tmp/lctrain-hf-1b]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

from lctrain.trainer.train.runtime import fake_cpu_device_flags  # imports no jax

os.environ["XLA_FLAGS"] = fake_cpu_device_flags(8)
os.environ["JAX_PLATFORMS"] = "cpu"

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402

# Llama 3.2 1B: 16 layers of width 2048, 32 query / 8 KV heads, tied 128,256-token vocabulary.
CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": True,
}


def write_checkpoint(folder: Path) -> int:
    """Writes the random checkpoint one tensor at a time; returns the parameter count."""
    from lctrain.trainer.hf.safetensors_io import write_folder

    c = CONFIG
    e, f = c["hidden_size"], c["intermediate_size"]
    q, kv = (c["num_attention_heads"] * c["head_dim"], c["num_key_value_heads"] * c["head_dim"])
    per_layer = {"input_layernorm.weight": (e,), "post_attention_layernorm.weight": (e,),
                 "self_attn.q_proj.weight": (q, e), "self_attn.k_proj.weight": (kv, e),
                 "self_attn.v_proj.weight": (kv, e), "self_attn.o_proj.weight": (e, q),
                 "mlp.gate_proj.weight": (f, e), "mlp.up_proj.weight": (f, e),
                 "mlp.down_proj.weight": (e, f)}
    shapes = [("model.embed_tokens.weight", (c["vocab_size"], e)), ("model.norm.weight", (e,))]
    shapes += [(f"model.layers.{i}.{name}", shape) for i in range(c["num_hidden_layers"])
               for name, shape in per_layer.items()]
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    write_folder(folder, shapes, np.dtype(ml_dtypes.bfloat16),
                 lambda name: 0.02 * rng.standard_normal(dict(shapes)[name], np.float32),
                 max_shard_bytes=2**30)
    (folder / "config.json").write_text(json.dumps(CONFIG))
    return sum(int(np.prod(shape)) for _, shape in shapes)


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakResident:
    """Samples this process's resident memory every 5 ms on a thread."""

    def __enter__(self):
        self.peak, self.running = resident_bytes(), True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, resident_bytes())
            time.sleep(0.005)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/lctrain-hf-1b"))
    args = parser.parse_args()
    if not (args.dir / "config.json").is_file():
        start = time.perf_counter()
        count = write_checkpoint(args.dir)
        print(f"wrote {count / 1e9:.2f}B parameters (bf16) to {args.dir} in "
              f"{time.perf_counter() - start:.0f} s")

    import jax

    from lctrain.recipes import load_recipe
    from lctrain.trainer.hf.convert import load_params
    from lctrain.trainer.state.build import mesh_for
    from lctrain.trainer.state.step import build_trainable

    recipe = load_recipe("tiny", [f"model.init=hf:{args.dir}", "mesh.data=1", "mesh.fsdp=8",
                                "data.seq_len=256"])
    trainable = build_trainable(recipe, mesh_for(recipe))
    abstract = trainable.abstract_state.params
    largest = max(x.size for x in jax.tree.leaves(abstract)) * 4
    before = resident_bytes()
    start = time.perf_counter()
    with PeakResident() as peak:
        params = load_params(recipe.model, trainable.state_shardings.params, abstract)
        jax.block_until_ready(params)
    seconds = time.perf_counter() - start
    after = resident_bytes()
    gib = 2**30
    print(f"load: {seconds:.1f} s on {len(jax.devices())} devices (fsdp=8) | RSS before "
          f"{before / gib:.2f} GiB, peak {peak.peak / gib:.2f} GiB, after {after / gib:.2f} "
          f"GiB | peak - after {(peak.peak - after) / gib:.2f} GiB = "
          f"{(peak.peak - after) / largest:.2f} x the largest tensor in float32 "
          f"({largest / gib:.2f} GiB)")


if __name__ == "__main__":
    main()
