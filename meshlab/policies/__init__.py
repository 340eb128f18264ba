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
from . import gpt2
from . import bert  # registers the hand-written policies
from . import vit  # registers the ViT policy
from . import t5  # registers the T5 policy
from . import whisper  # registers the Whisper policy
from . import gptj  # registers the GPT-J policy
from . import opt  # registers the OPT policy
from . import bloom  # registers the BLOOM policy
from . import falcon  # registers the Falcon policy
from . import sam  # registers the SAM policy
from . import blip_2  # registers the BLIP-2 policy
