"""The scope name the model puts around a layer kind's branch and the HLO reader finds in
compiled programs (parallel/hlo.py): one home below both, so the model takes no name
from the HLO reader (as kernels/residuals.py is the home of remat names)."""

import re

# The model's scan over layers of several kinds picks each layer's kind with a switch;
# the collectives of a kind's branch run in only `count` of the scan's `layers` steps.
LAYER_SHARE = re.compile(r"layers_of_kind_\w+?_(\d+)_of_(\d+)")


def layer_share_scope(kind: str, count: int, layers: int) -> str:
    """The jax.named_scope around a layer kind's branch, from which parallel/hlo.py reads
    that its collectives run in count of layers scan steps."""
    return f"layers_of_kind_{kind}_{count}_of_{layers}"
