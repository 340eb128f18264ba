"""Checkpoints: sharded DCP save/load (atomic, async, reshardable) and Hugging Face
safetensors export/import.

>>> from meshlab import checkpoint
>>> checkpoint.save('ckpt/step-100', model, opt, extra={'step': 100})   # doctest: +SKIP
>>> extra, report = checkpoint.load(checkpoint.latest('ckpt'), model, opt)  # doctest: +SKIP
"""

from ._safe import CheckpointError as CheckpointError
from ._dcp import (save as save, load as load, latest as latest, wait as wait,
                   is_complete as is_complete, LoadReport as LoadReport)
from ._hf import save_pretrained as save_pretrained, load_pretrained as load_pretrained
