"""Checkpoint round trip: sharded state and data position come back exactly; only the
newest `keep` stay; an unfinished save is never taken for the latest."""

import jax
import numpy as np

from lctrain.recipes import load_recipe
from lctrain.trainer.state.build import mesh_for
from lctrain.trainer.state.checkpoint import Checkpointer
from lctrain.trainer.state.step import build_trainable


def test_round_trip_keeps_values_shardings_and_position(tmp_path):
    recipe = load_recipe("tiny", ["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
                                "checkpoint.every=10", "checkpoint.keep=2"])
    mesh = mesh_for(recipe)
    trainable = build_trainable(recipe, mesh)
    state = trainable.init()
    checkpointer = Checkpointer(tmp_path, recipe.checkpoint)
    assert checkpointer.save(state, 10, next_batch=10)
    assert not checkpointer.save(state, 15, next_batch=15)          # not on the interval
    assert checkpointer.save(state, 15, next_batch=15, force=True)  # the final save
    assert checkpointer.save(state._replace(step=state.step + 20), 20, next_batch=21)
    checkpointer.close()

    reopened = Checkpointer(tmp_path, recipe.checkpoint)
    assert reopened.manager.all_steps() == [15, 20]                 # keep=2
    restored, next_batch = reopened.restore(trainable.abstract_state)
    assert next_batch == 21 and int(restored.step) == 20
    for ours, original in zip(jax.tree.leaves(restored.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(ours, original)
        assert ours.sharding == original.sharding
    embedding = restored.params["embedding"]
    # vocab over tensor, width over fsdp and the context axes
    assert tuple(embedding.sharding.spec) == ("tensor", ("fsdp", "context", "ulysses"))
    for ours, original in zip(jax.tree.leaves(restored.opt_state),
                              jax.tree.leaves(state.opt_state)):
        np.testing.assert_array_equal(ours, original)
    reopened.close()


def test_unfinished_save_is_ignored(tmp_path):
    recipe = load_recipe("tiny", ["checkpoint.every=1"])
    trainable = build_trainable(recipe, mesh_for(recipe))
    checkpointer = Checkpointer(tmp_path, recipe.checkpoint)
    checkpointer.save(trainable.init(), 1, next_batch=1)
    checkpointer.close()
    # What a crash mid-save leaves behind: orbax's temporary folder, never renamed.
    (tmp_path / "2.orbax-checkpoint-tmp-1234").mkdir()
    assert Checkpointer(tmp_path, recipe.checkpoint).latest_step() == 1
