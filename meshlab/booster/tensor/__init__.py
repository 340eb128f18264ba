"""Colossal-AI's ``colossalai.tensor`` names a script or test imports: ``ColoParameter``
(a parameter a plugin sharded) and ``d_tensor.api.clear_layout_converter``."""

from .colo_parameter import ColoParameter as ColoParameter
