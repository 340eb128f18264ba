"""``meshlab.losses``: the losses that read vocabulary-sharded logits.

They live with the transforms (``meshlab.transforms.losses``), since the tensor-parallel
room, the estimates and the step all use them; this module keeps the public path.
"""

from .transforms.losses import (VocabGuard as VocabGuard, causal_lm_loss as causal_lm_loss,
                                cross_entropy as cross_entropy, guard_model as guard_model,
                                hf_loss as hf_loss, masked_lm_loss as masked_lm_loss)
