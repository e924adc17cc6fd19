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

Accuracy (--check-seq-len, on an accelerator; 0 skips it): before timing, each kernel's
out, lse and gradients (bf16 inputs, a random output cotangent) against the xla kernel in
f32 at 'highest' matmul precision, on the same mask layouts: max error relative to the
reference's largest value (lse absolute). The interpret-mode tests prove the kernels on a
CPU; this proves what Mosaic or Triton compiled for the chip.

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


def attention_loss(impl: str, platform: str | None, block: int | tuple[int, int]):
    """(q, k, v, positions, segments) -> sum of causal attention's output, for
    value_and_grad; `block` is block_q = block_kv, or (block_q, block_kv)."""
    block_q, block_kv = block if isinstance(block, tuple) else (block, block)

    def loss(q, k, v, positions, segments):
        out = kernels.attention(q, k, v, q_positions=positions, kv_positions=positions,
                                q_segment_ids=segments, kv_segment_ids=segments, causal=True,
                                impl=impl, block_q=block_q, block_kv=block_kv,
                                platform=platform)
        return jnp.sum(out.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def shapes(seq_len: int, dtype, head_dim: int = HEAD_DIM) -> tuple[jax.ShapeDtypeStruct, ...]:
    return (jax.ShapeDtypeStruct((1, seq_len, HEADS, head_dim), dtype),
            jax.ShapeDtypeStruct((1, seq_len, KV_HEADS, head_dim), dtype),
            jax.ShapeDtypeStruct((1, seq_len, KV_HEADS, head_dim), dtype),
            jax.ShapeDtypeStruct((1, seq_len), jnp.int32),
            jax.ShapeDtypeStruct((1, seq_len), jnp.int32))


def document_lengths(seq_len: int, layout: str) -> list[int]:
    """One causal document, or four packed ones of unequal lengths."""
    if layout == "causal":
        return [seq_len]
    cuts = [0, seq_len // 5, seq_len // 2, 4 * seq_len // 5, seq_len]
    return [b - a for a, b in zip(cuts, cuts[1:])]


def ids(seq_len: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """(positions, segment ids), [1, seq_len] each. The positions are sequence indices,
    as every strategy hands the kernels (ContextStrategy.attend: segment ids keep the
    documents apart); splash needs them so (positions restarting in every document broke
    its layout rule, and its dk/dv kernel halted a v5e chip)."""
    lengths = document_lengths(seq_len, layout)
    return (np.arange(seq_len)[None].astype(np.int32),
            np.repeat(np.arange(len(lengths)), lengths)[None].astype(np.int32))


def causal_flops(seq_len: int, layout: str = "causal", head_dim: int = HEAD_DIM) -> float:
    forward = sum(4 * (n * n / 2) * HEADS * head_dim for n in document_lengths(seq_len, layout))
    return 3.5 * forward


def cudnn_loss():
    """The vendor's fused attention on a GPU (cuDNN), beside ours as splash is on a TPU."""

    def loss(q, k, v, positions, segments):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
        return jnp.sum(out.astype(jnp.float32))

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def time_impl(impl: str, seq_len: int, block: int | tuple[int, int], repeats: int, dtype,
              layout: str = "causal", head_dim: int = HEAD_DIM) -> float:
    """Median seconds of one forward+backward on the default backend."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(s.shape), s.dtype)
               for s in shapes(seq_len, dtype, head_dim)[:3])
    step = jax.jit(cudnn_loss() if impl == "cudnn" else attention_loss(impl, None, block))
    args = (q, k, v, *map(jnp.asarray, ids(seq_len, layout)))
    jax.block_until_ready(step(*args))
    runs = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(step(*args))
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


ERROR_NAMES = ("out", "lse", "dq", "dk", "dv")


def outputs_and_grads(impl: str, block: int, q, k, v, positions, segments, cotangent):
    """(out, lse, dq, dk, dv) of causal attention under a random output cotangent."""
    def attend(q, k, v):
        return kernels.attention(q, k, v, q_positions=positions, kv_positions=positions,
                                 q_segment_ids=segments, kv_segment_ids=segments,
                                 causal=True, impl=impl, block_q=block, block_kv=block,
                                 return_lse=True)

    (out, lse), vjp = jax.vjp(attend, q, k, v)
    return (out, lse, *vjp((cotangent.astype(out.dtype), jnp.zeros_like(lse))))


def kernel_errors(impl: str, seq_len: int, layout: str, block: int = 512) -> dict[str, float]:
    """`impl` with bf16 inputs and blocks of `block` against the xla kernel in f32 at
    'highest' precision: max abs error of out, dq, dk, dv over the reference's largest
    value; of lse, absolute."""
    rng = np.random.default_rng(1)
    q_shape, kv_shape = (s.shape for s in shapes(seq_len, jnp.float32)[:2])
    q, k, v, cotangent = (rng.standard_normal(shape, np.float32)
                          for shape in (q_shape, kv_shape, kv_shape, q_shape))
    positions, segments = map(jnp.asarray, ids(seq_len, layout))
    run = jax.jit(outputs_and_grads, static_argnums=(0, 1))
    with jax.default_matmul_precision("highest"):
        want = run("xla", block, q, k, v, positions, segments, cotangent)
    got = run(impl, block, *(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), positions,
              segments, cotangent)
    errors = {}
    for name, g, w in zip(ERROR_NAMES, got, want):
        g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
        scale = 1.0 if name == "lse" else float(np.max(np.abs(w)))
        errors[name] = float(np.max(np.abs(g - w))) / scale
    return errors


def print_errors(impls: list[str], args) -> None:
    print(f"\nagainst the xla kernel in f32 ('highest'), {args.check_seq_len} tokens, bf16 "
          f"inputs, blocks {args.block}: max error / max |reference| (lse: absolute)")
    print(f"{'layout':<8}{'impl':<8}" + "".join(f"{name:>9}" for name in ERROR_NAMES))
    for layout in args.layouts:
        for impl in (name for name in impls if name != "cudnn"):
            errors = kernel_errors(impl, args.check_seq_len, layout, args.block)
            print(f"{layout:<8}{kernels.resolve_impl(impl):<8}"
                  + "".join(f"{errors[name]:>9.1e}" for name in ERROR_NAMES), flush=True)


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
    the strategies make: one document; four packed; a ring step
    against an earlier chunk and against its own; one rank of a 4-way load-balanced
    all_gather (its queries against the whole stored sequence)."""
    index, one = np.arange(s)[None], np.zeros((1, s), np.int64)
    _, segments = ids(s, "packed")
    order = load_balanced_order(s, 4)[None]
    return {"causal": (index, index, one, one, True),
            "packed, 4 documents": (index, index, segments, segments, True),
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
                        help="default: xla on CPU; pallas, splash, xla on TPU; triton, "
                             "cudnn, xla on GPU")
    parser.add_argument("--time-seq-lens", type=int, nargs="*", default=None,
                        help="default: 8K, 32K, 128K on an accelerator; 2K, 4K, 8K on CPU")
    parser.add_argument("--memory", metavar="TOPOLOGY", default=None,
                        help="also compile for one chip of this TPU topology, e.g. v5p:2x2x1")
    parser.add_argument("--memory-seq-lens", type=int, nargs="+",
                        default=[32768, 131072, 524288])
    parser.add_argument("--check-seq-len", type=int, default=4096,
                        help="tokens of the accuracy check on an accelerator (0: none)")
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
    if backend == "tpu":  # triton is the GPU kernel
        impls = args.impls or ["pallas", "splash", "xla"]
    if args.time_seq_lens is None:
        args.time_seq_lens = [2048, 4096, 8192] if backend == "cpu" else [8192, 32768, 131072]
    if backend == "cpu" and not args.impls:
        print("no accelerator here (jax's backend is cpu, where the Pallas kernels run "
              "interpreted): no timing, the kernels' structure instead")
        print_structure(args.relayouts)
        args.time_seq_lens = []
    else:
        print(f"causal attention, 1 x seq x {HEADS} heads ({KV_HEADS} KV) x {HEAD_DIM}, "
              f"bf16, blocks {args.block}; forward+backward")
    if backend != "cpu" and args.check_seq_len:
        print_errors(impls, args)
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
