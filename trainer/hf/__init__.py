"""Hugging Face model folders: safetensors read and written a slice at a time
(safetensors_io.py), their names and layouts mapped to ours (convert.py), where a command
takes its weights from (weights.py), and a run exported back as a folder (export.py).

May import recipes/, parallel/ and trainer.{outputs, model, data, state}."""
