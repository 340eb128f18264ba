"""What fuse shares with the rest of meshlab: the pieces of its routing that the inference
engine's merged products (``meshlab.inference._merge``) build on, under public names.

* ``gate_kind(mlp)``: ``'swiglu'``, ``'geglu'`` or None, the gated MLP's activation;
* ``bare_linear(m, dtype, bias=False)``: whether ``m`` is an ``nn.Linear`` whose call is
  its weight's matmul alone (no hooks or subclass, a plain weight of ``dtype``; plus its
  bias where ``bias`` allows one);
* ``Handoff``: a query projection's product handing the key and value parts to theirs;
* ``probe_layer(layer, forward, prepare)``: why a decoder layer's class cannot take
  ``forward`` (a small copy run both ways), or None;
* ``norm_eps``, ``norm_rule``, ``set_norm_rule``: a routed RMS norm's epsilon and rule;
* ``layer_routed(layer)``: whether fuse gave a decoder layer its fused residual add.
"""

from ._hf import _gate_kind as gate_kind
from ._residual import Handoff as Handoff, _bare_linear as bare_linear
from ._residual import _probe_layer as probe_layer, layer_routed as layer_routed
from ._residual import norm_eps as norm_eps, norm_rule as norm_rule, set_norm_rule as set_norm_rule

__all__ = ["gate_kind", "bare_linear", "Handoff", "probe_layer", "norm_eps", "norm_rule",
           "set_norm_rule", "layer_routed"]
