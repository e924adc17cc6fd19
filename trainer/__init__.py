"""Model, train state and step, loop, data, checkpoints and metrics."""
