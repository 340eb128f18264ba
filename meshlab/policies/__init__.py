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
from . import vit as vit  # registers the ViT policy
from . import t5 as t5  # registers the T5 policy
from . import whisper as whisper  # registers the Whisper policy
from . import gptj as gptj  # registers the GPT-J policy
from . import opt as opt  # registers the OPT policy
from . import bloom as bloom  # registers the BLOOM policy
from . import falcon as falcon  # registers the Falcon policy
from . import sam as sam  # registers the SAM policy
from . import blip_2 as blip_2  # registers the BLIP-2 policy
