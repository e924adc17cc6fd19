"""Attention kernels side by side: forward+backward time and TFLOP/s where they run, and
compiled memory per chip for a TPU from XLA's compiler (libtpu ahead-of-time).

    python benchmarks/attention.py                      # time on this machine's backend
    python benchmarks/attention.py --memory v5p:2x2x1   # + per-chip memory, compiled

Without an accelerator (jax's backend is the CPU, where the Pallas kernels only run
interpreted) it says so and prints the Pallas kernels' structure instead
(kernels/pallas_structure.py): K/V block copies against computed block pairs and grid
steps, per mask layout; matmuls per block pair; and with --relayouts TOPOLOGY the
relayout copies beside the kernel calls of each strategy's compiled train step
(parallel/hlo_kernels.py).

Timing: causal attention of one sequence of --time-seq-lens tokens with Llama 3.1 8B's
heads (32 query / 8 KV of 128, bf16), `jax.value_and_grad` of the output's sum, median of
--repeats runs after a warm-up. TFLOP/s counts the causal half of the score matrix:
forward 2 matmuls = 4 s^2/2 h d flops, backward 2.5x the forward. On a CPU only `xla`
runs at a useful speed (the Pallas kernel runs in interpret mode there: pass --impls
pallas to see it, at small lengths). On a GPU it times our Triton kernel and xla beside
cuDNN's fused attention (jax.nn.dot_product_attention), for one causal document and for
four packed ones (--layouts); cuDNN takes no segment ids through that call, so it has no
packed row. TFLOP/s of a packed row counts each document's causal half only. --json
writes the rows.

Memory: the same forward+backward compiled for ONE chip of the topology at --memory-seq-
lens tokens (32K, 128K, 512K: what one chip holds under context parallelism), peak HBM
and temporaries as memory_analysis() reports them. Needs the tpu extra.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lctrain import kernels
from lctrain.kernels import pallas_structure
from lctrain.parallel.native_stderr import shown_only_on_failure
from lctrain.parallel.strategy import load_balanced_order

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
STRUCTURE_TOKENS, STRUCTURE_BLOCK = 4096, 512


def attention_loss(impl: str, platform: str | None, block: int):
    """(q, k, v, positions, segments) -> sum of causal attention's output, for
    value_and_grad."""

    def loss(q, k, v, positions, segments):
        out = kernels.attention(q, k, v, q_positions=positions, kv_positions=positions,
                                q_segment_ids=segments, kv_segment_ids=segments, causal=True,
                                impl=impl, block_q=block, block_kv=block, platform=platform)
        return jnp.sum(out.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def shapes(seq_len: int, dtype) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((1, seq_len, HEADS, HEAD_DIM), dtype),
            jax.ShapeDtypeStruct((1, seq_len, KV_HEADS, HEAD_DIM), dtype),
            jax.ShapeDtypeStruct((1, seq_len, KV_HEADS, HEAD_DIM), dtype),
            jax.ShapeDtypeStruct((1, seq_len), jnp.int32),
            jax.ShapeDtypeStruct((1, seq_len), jnp.int32))


def document_lengths(seq_len: int, layout: str) -> list[int]:
    """One causal document, or four packed ones of unequal lengths."""
    if layout == "causal":
        return [seq_len]
    cuts = [0, seq_len // 5, seq_len // 2, 4 * seq_len // 5, seq_len]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def ids(seq_len: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions restarting per document, segment ids), [1, seq_len] each."""
    lengths = document_lengths(seq_len, layout)
    return (np.concatenate([np.arange(n) for n in lengths])[None].astype(np.int32),
            np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32))


def causal_flops(seq_len: int, layout: str = "causal") -> float:
    forward = sum(4 * (n * n / 2) * HEADS * HEAD_DIM for n in document_lengths(seq_len, layout))
    return 3.5 * forward


def cudnn_loss():
    """The vendor's fused attention on a GPU (cuDNN), beside ours as splash is on a TPU."""

    def loss(q, k, v, positions, segments):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def time_impl(impl: str, seq_len: int, block: int, repeats: int, dtype,
              layout: str = "causal") -> float:
    """Median seconds of one forward+backward on the default backend."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s.shape), s.dtype)
               for s in shapes(seq_len, dtype)[:3])
    step = jax.jit(cudnn_loss() if impl == "cudnn" else attention_loss(impl, None, block))
    args = (q, k, v, *map(jnp.asarray, ids(seq_len, layout)))
    jax.block_until_ready(step(*args))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def compiled_memory(impl: str, seq_len: int, block: int, device, dtype) -> tuple[int, int]:
    """(peak HBM bytes, temporaries) of forward+backward compiled for one TPU chip."""
    from lctrain.parallel.aot import compiled_stats

    mesh = Mesh(np.array([device]), ("chip",))
    args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=NamedSharding(mesh, P()))
            for s in shapes(seq_len, dtype)]
    # Inside a shard_map, as the strategies call it: Mosaic reads the chip from its mesh.
    on_chip = jax.shard_map(attention_loss(impl, "tpu", block), mesh=mesh,
                            in_specs=P(), out_specs=P(), check_vma=False)
    compiled = jax.jit(on_chip).lower(*args).compile()
    stats = compiled_stats(compiled)
    return stats.hbm_bytes, stats.temp_bytes


def _mask_layouts(s: int) -> dict[str, tuple]:
    """(q positions, kv positions, q segments, kv segments, causal) [1, s] of the calls
    the strategies make: one document; four packed (positions restarting); a ring step
    against an earlier chunk and against its own; one rank of a 4-way load-balanced
    all_gather (its queries against the whole stored sequence)."""
    index, one = np.arange(s)[None], np.zeros((1, s), np.int64)
    restarted, segments = ids(s, "packed")
    order = load_balanced_order(s, 4)[None]
    return {"causal": (index, index, one, one, True),
            "packed, 4 documents": (restarted, restarted, segments, segments, True),
            "ring step, earlier chunk": (index + s, index, one, one, True),
            "ring step, own chunk": (index + s, index + s, one, one, True),
            "all_gather rank 0 of 4": (order[:, :s // 4], order, one[:, :s // 4], one, True)}


def print_structure(topology: str | None) -> None:
    print(f"\nPallas kernel structure (forward grid, {STRUCTURE_TOKENS} tokens, blocks of "
          f"{STRUCTURE_BLOCK}, 4 query heads on 2 KV heads)")
    print(f"{'mask':<26}{'grid steps':>11}{'computed':>10}{'K/V copies':>12}")
    for name, layout in _mask_layouts(STRUCTURE_TOKENS).items():
        ids = tuple(np.asarray(x, np.int32) for x in layout[:4])
        sched = pallas_structure.schedule(*ids, layout[4], block=STRUCTURE_BLOCK)
        figures = pallas_structure.kv_copy_figures(sched)
        print(f"{name:<26}{figures.steps:>11}{figures.computed:>10}{figures.copies:>12}")
    print("(a skipped step names the block already in VMEM: copies = computed pairs less "
          "those reusing the previous block)")
    per_pair = pallas_structure.matmuls_per_block_pair()
    print("matmuls per computed block pair: " + ", ".join(
        f"{name} {count}" for name, count in per_pair.items()))
    if topology:
        print_relayouts(topology)


def print_relayouts(topology: str) -> None:
    """Relayout copies beside the kernel calls of a small train step (head dim 128) per
    strategy and kernel, compiled for `topology`."""
    from lctrain.parallel import aot
    from lctrain.parallel.hlo_kernels import kernel_calls, relayouts_next_to_kernels
    from lctrain.recipes import load_recipe
    from lctrain.trainer.state import build

    names = {"pallas": kernels.pallas.MOSAIC_NAMES, "splash": kernels.splash.MOSAIC_NAMES}
    devices = aot.topology_devices(topology)
    print(f"\nrelayouts beside the kernel calls, train step compiled for {topology}")
    print(f"{'strategy':<12}{'kernel':<8}{'calls':>6}{'relayouts':>11}")
    for strategy in ("all_gather", "ulysses", "ring", "usp"):
        for impl, kernel_names in names.items():
            recipe = load_recipe("tiny", [
                "model.layers=2", "model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=2",
                "model.d_ff=2048", "model.vocab=1024", "model.dtype=bfloat16",
                f"attention.impl={impl}", f"parallel.strategy={strategy}", "mesh.data=1",
                "mesh.context=-1", "data.seq_len=8192", "data.batch_size=1",
                *(["parallel.ulysses=2"] if strategy == "usp" else [])])
            text = build.compile_train_step(recipe, devices).as_text()
            found = relayouts_next_to_kernels(text, kernel_names, 1 << 19)
            print(f"{strategy:<12}{impl:<8}{len(kernel_calls(text, kernel_names)):>6}"
                  f"{len(found):>11}", flush=True)


def print_timings(impls: list[str], args, dtype) -> list[dict]:
    """One row per (layout, impl, length): ms and TFLOP/s, printed as they come."""
    device = jax.devices()[0].device_kind
    print(f"\ntime on {jax.default_backend()} ({device})")
    print(f"{'layout':<8}{'impl':<8}{'seq_len':>9}{'ms':>12}{'TFLOP/s':>10}")
    rows = []
    for layout in args.layouts:
        for impl in impls:
            if impl == "cudnn" and layout != "causal":
                continue  # no segment ids through jax.nn.dot_product_attention
            for seq_len in args.time_seq_lens:
                seconds = time_impl(impl, seq_len, args.block, args.repeats, dtype, layout)
                name = impl if impl == "cudnn" else kernels.resolve_impl(impl)
                tflops = causal_flops(seq_len, layout) / seconds / 1e12
                print(f"{layout:<8}{name:<8}{seq_len:>9}{seconds * 1e3:>12.1f}{tflops:>10.3f}",
                      flush=True)
                rows.append(dict(device=device, layout=layout, impl=name, seq_len=seq_len,
                                 ms=seconds * 1e3, tflops=tflops))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--impls", nargs="+", default=None, choices=kernels.IMPLS,
                        help="default: xla on CPU, every kernel elsewhere")
    parser.add_argument("--time-seq-lens", type=int, nargs="*", default=None,
                        help="default: 8K, 32K, 128K on a GPU; 2K, 4K, 8K elsewhere")
    parser.add_argument("--memory", metavar="TOPOLOGY", default=None,
                        help="also compile for one chip of this TPU topology, e.g. v5p:2x2x1")
    parser.add_argument("--memory-seq-lens", type=int, nargs="+",
                        default=[32768, 131072, 524288])
    parser.add_argument("--block", type=int, default=512, help="block_q = block_kv")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layouts", nargs="+", default=["causal", "packed"],
                        choices=["causal", "packed"], help="timed mask layouts")
    parser.add_argument("--json", metavar="PATH", default=None, help="also write the timed rows")
    parser.add_argument("--relayouts", metavar="TOPOLOGY", default=None,
                        help="without an accelerator: also count relayouts beside the kernel "
                             "calls of each strategy compiled for this TPU topology")
    args = parser.parse_args(argv)
    dtype = jnp.bfloat16
    with shown_only_on_failure():  # libtpu's start-up warnings where no TPU is attached
        backend = jax.default_backend()
    impls = args.impls or list(kernels.IMPLS)
    if backend == "gpu":  # pallas and splash are TPU kernels: ours is triton there
        impls = args.impls or ["triton", "cudnn", "xla"]
    if args.time_seq_lens is None:
        args.time_seq_lens = [8192, 32768, 131072] if backend == "gpu" else [2048, 4096, 8192]
    if backend == "cpu" and not args.impls:
        print("no accelerator here (jax's backend is cpu, where the Pallas kernels run "
              "interpreted): no timing, the kernels' structure instead")
        print_structure(args.relayouts)
        args.time_seq_lens = []
    else:
        print(f"causal attention, 1 x seq x {HEADS} heads ({KV_HEADS} KV) x {HEAD_DIM}, "
              f"bf16, blocks {args.block}; forward+backward")
    if args.time_seq_lens:
        rows = print_timings(impls, args, dtype)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.memory:
        from lctrain.parallel.aot import topology_devices

        device = topology_devices(args.memory)[0]
        print(f"\ncompiled for one chip of {args.memory} ({device.device_kind}), GiB")
        print(f"{'impl':<8}{'seq_len':>9}{'peak HBM':>10}{'temp':>10}{'compile s':>11}")
        for impl in args.impls or kernels.IMPLS:
            for seq_len in args.memory_seq_lens:
                start = time.perf_counter()
                try:
                    hbm, temp = compiled_memory(impl, seq_len, args.block, device, dtype)
                except ValueError as err:  # a kernel refusing the lengths (splash's map)
                    print(f"{impl:<8}{seq_len:>9}  not compiled: {err}", flush=True)
                    continue
                print(f"{impl:<8}{seq_len:>9}{hbm / 2**30:>10.2f}{temp / 2**30:>10.2f}"
                      f"{time.perf_counter() - start:>11.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
