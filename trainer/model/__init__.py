"""The model: the Llama-style Transformer and its hybrid layers (transformer.py,
gdn_layer.py), how its stacked layers are scanned (layer_scan.py), RoPE (rope.py), how
layers hold parameters (params.py), the loss (loss.py) and what each layer keeps for
backward (remat.py).

May import kernels/, recipes/, parallel/ and trainer.outputs."""
