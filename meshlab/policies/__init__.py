"""Per-architecture sharding policies: data, keyed on ``config.model_type``.

>>> from meshlab import policies
>>> policies.auto
policies.auto
"""

from ._policy import ModuleRule as ModuleRule, Policy as Policy, style_specs as style_specs
from ._registry import (auto as auto, from_hf_tp_plan as from_hf_tp_plan, get as get,
                        register as register, registered as registered,
                        resolve_policy as resolve_policy, _Auto as _Auto)
from ._decoder import DECODER as DECODER
from . import gpt2 as gpt2, bert as bert  # registers the hand-written policies
