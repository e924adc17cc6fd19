"""Train state, its sharded initialisation, and the jitted train step."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from lctrain.parallel import LayerStrategies
from lctrain.parallel.sharding import batch_sharding, parameter_shardings, replicated
from lctrain.parallel.token_chunks import chunks_for
from lctrain.recipes.schema import Recipe
from lctrain.trainer.model.loss import LossAux, next_token_loss
from lctrain.trainer.model.remat import layer_input_pieces, remat_policy
from lctrain.trainer.model.transformer import Transformer
from lctrain.trainer.state.optimizer import learning_rate_schedule, make_optimizer

BATCH_FIELDS = ("inputs", "targets", "positions", "segment_ids", "loss_mask")
HOST = "pinned_host"   # the memory kind optimizer.offload keeps the moments in


class TrainState(NamedTuple):
    step: jax.Array
    params: dict
    opt_state: optax.OptState


class Trainable(NamedTuple):
    """Everything the loop needs to build, restore and step the state."""
    graphdef: nnx.GraphDef
    optimizer: optax.GradientTransformation
    init: Callable[[], TrainState]          # jitted, returns the sharded initial state
    start_from: Callable[[dict], TrainState]  # jitted: given parameters, a fresh optimizer
    abstract_state: TrainState              # ShapeDtypeStructs with shardings (for restore/AOT)
    state_shardings: TrainState


def build_trainable(recipe: Recipe, mesh: Mesh) -> Trainable:
    optimizer = make_optimizer(recipe.train)

    def fresh_state() -> TrainState:
        model = Transformer(recipe.model, nnx.Rngs(recipe.train.seed))
        params = nnx.to_pure_dict(nnx.state(model))
        return TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params))

    abstract_model = nnx.eval_shape(lambda: Transformer(recipe.model, nnx.Rngs(0)))
    graphdef, abstract_params = nnx.split(abstract_model)
    param_shardings = parameter_shardings(mesh, abstract_params)
    shapes = jax.eval_shape(fresh_state)

    def moment_sharding(_, sharding):
        # optimizer.offload: the moments (shaped like the parameters) live in pinned host
        # memory between steps; counters and other scalars stay on the device.
        return sharding.with_memory_kind(HOST) if recipe.optimizer.offload else sharding

    shardings = TrainState(
        step=replicated(mesh),
        params=param_shardings,
        opt_state=optax.tree_map_params(
            optimizer, moment_sharding, shapes.opt_state, param_shardings,
            transform_non_params=lambda _: replicated(mesh)),
    )
    abstract_state = jax.tree.map(
        lambda shape, sharding: jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=sharding),
        shapes, shardings)
    init = jax.jit(fresh_state, out_shardings=shardings)
    start_from = jax.jit(
        lambda params: TrainState(jnp.zeros((), jnp.int32), params, optimizer.init(params)),
        out_shardings=shardings, donate_argnums=0)
    return Trainable(graphdef, optimizer, init, start_from, abstract_state, shardings)



def _moved(tree, shardings, kind: str):
    """The leaves whose sharding says pinned host memory, put into `kind` memory ('device'
    to compute on them inside the jitted step, HOST to put them back); the rest as is."""
    return jax.tree.map(
        lambda x, sharding: (jax.device_put(x, sharding.with_memory_kind(kind))
                             if sharding.memory_kind == HOST else x),
        tree, shardings)


def batch_shardings(mesh: Mesh) -> dict[str, Any]:
    return {name: batch_sharding(mesh) for name in BATCH_FIELDS}


def make_forward(recipe: Recipe, graphdef: nnx.GraphDef,
                 strategy: LayerStrategies) -> Callable:
    """(params, batch) -> (model, final hidden states [b, s, d]) under the strategies (each
    layer attends with its kind's)."""
    policy = remat_policy(recipe.remat)
    mesh = strategy.mesh
    batch_shards = mesh.shape["data"] * mesh.shape["fsdp"]

    def pieces(shape):  # rows x tokens of one chip's layer input
        return layer_input_pieces(recipe, shape[0] // batch_shards,
                                  shape[1] // strategy.sequence_shards) or 1

    def forward(params, batch):
        model = nnx.merge(graphdef, params)
        mlp_chunks = chunks_for(recipe.remat.mlp_chunk_tokens, batch["inputs"].shape[1],
                                strategy.sequence_shards)
        hidden = model(batch["inputs"], batch["positions"], batch["segment_ids"],
                       attend=strategy.attends, split_tokens=strategy.split_tokens,
                       remat_policy=policy, mlp_chunks=mlp_chunks,
                       gather_weight=strategy.gather_weight,
                       layers_per_checkpoint=recipe.remat.layers_per_checkpoint,
                       layer_input_pieces=pieces(batch["inputs"].shape))
        return model, hidden

    return forward


def make_loss_sums(recipe: Recipe, graphdef: nnx.GraphDef,
                   strategy: LayerStrategies) -> Callable:
    """(params, batch) -> (sum of token losses, LossAux(counted tokens, z-loss part)): the
    model and loss as the train step differentiates them."""
    forward = make_forward(recipe, graphdef, strategy)

    def loss_sums(params, batch):
        model, hidden = forward(params, batch)
        return next_token_loss(hidden, model.output_weights(), batch["targets"],
                               batch["loss_mask"], recipe.train.z_loss, recipe.loss,
                               sequence_shards=strategy.sequence_shards)

    return loss_sums


def make_train_step(recipe: Recipe, trainable: Trainable, strategy: LayerStrategies,
                    mesh: Mesh) -> Callable:
    """The jitted step: (state, batch) -> (new state, metrics); the state is donated."""
    accum_steps = recipe.train.grad_accum_steps
    schedule = learning_rate_schedule(recipe.train)
    loss_sums = make_loss_sums(recipe, trainable.graphdef, strategy)

    sums_and_grads = jax.value_and_grad(loss_sums, has_aux=True)

    def accumulate(params, batch):
        if accum_steps == 1:
            return sums_and_grads(params, batch)

        # Micro-batch a takes rows a, a+A, a+2A, ...: every micro-batch stays spread over
        # all data-parallel devices instead of living on a few of them.
        def split(x):
            return jnp.moveaxis(x.reshape(x.shape[0] // accum_steps, accum_steps, *x.shape[1:]),
                                1, 0)

        def add_micro_batch(total, micro_batch):
            return jax.tree.map(jnp.add, total, sums_and_grads(params, micro_batch)), None

        zeros = ((jnp.zeros(()), LossAux(jnp.zeros(()), jnp.zeros(()))),
                 jax.tree.map(jnp.zeros_like, params))
        total, _ = jax.lax.scan(add_micro_batch, zeros, jax.tree.map(split, batch))
        return total

    def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
        (loss_sum, aux), grad_sums = accumulate(state.params, batch)
        token_count = jnp.maximum(aux.tokens, 1.0)
        grads = jax.tree.map(lambda g: g / token_count, grad_sums)
        # optimizer.offload: moments from host memory for the update, then back. (It saves
        # HBM between steps, not at the step's compiled peak, which rises by about the
        # moments' size although XLA's TPU compiler schedules the copies after the backward.)
        opt_shardings = trainable.state_shardings.opt_state
        opt_state = _moved(state.opt_state, opt_shardings, "device")
        updates, opt_state = trainable.optimizer.update(grads, opt_state, state.params)
        opt_state = _moved(opt_state, opt_shardings, HOST)
        params = optax.apply_updates(state.params, updates)
        # Logged: the cross-entropy, and the z-loss regulariser apart from it.
        loss = (loss_sum - aux.z_loss) / token_count
        grad_norm = optax.tree_utils.tree_norm(grads)
        metrics = {"loss": loss, "z_loss": aux.z_loss / token_count, "grad_norm": grad_norm,
                   "lr": schedule(state.step),
                   "finite": jnp.isfinite(loss) & jnp.isfinite(grad_norm)}
        return TrainState(state.step + 1, params, opt_state), metrics

    return jax.jit(train_step, in_shardings=(trainable.state_shardings, batch_shardings(mesh)),
                   out_shardings=(trainable.state_shardings, replicated(mesh)),
                   donate_argnums=0)
