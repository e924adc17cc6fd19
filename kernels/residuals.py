"""The name under which remat policies find attention's results (recipe: remat.tensors)."""

from jax.ad_checkpoint import checkpoint_name

CONTEXT = "context"


def named_results(out, lse):
    """out and lse named CONTEXT, for use inside a custom VJP's forward rule: a policy that
    keeps CONTEXT then keeps both residuals the backward needs, and the attention forward
    is not run again in the backward. A name put on the output outside the rule reaches
    neither residual: remat would re-run the whole forward to get lse."""
    return checkpoint_name(out, CONTEXT), checkpoint_name(lse, CONTEXT)
