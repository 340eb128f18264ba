"""Which transformers class builds a config: the auto classes in a fixed order, else the
config's own modeling module (``auto_class``), and building with it (``from_config``).
The presets and the family walk build their models through these."""

from __future__ import annotations


_AUTO = (("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
         ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "AutoModelForSeq2SeqLM"),
         ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
         ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "AutoModelForImageClassification"),
         ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "AutoModelForMaskedLM"),
         ("MODEL_MAPPING_NAMES", "AutoModel"))


def auto_class(config):
    """The class to build ``config`` with: the first auto class of causal LM, seq2seq LM,
    speech seq2seq, image classification, masked LM and the base ``AutoModel`` that maps
    its ``model_type`` (an encoder-decoder config tries the seq2seq ones first), else the
    model class of the config's own transformers module (``own_model_class``). Raises
    ``ConfigError`` naming the model type when none builds it."""
    import transformers
    from transformers.models.auto import modeling_auto as A

    from ..core.errors import ConfigError

    mt = getattr(config, "model_type", None)
    order = _AUTO[1:3] + _AUTO if getattr(config, "is_encoder_decoder", False) else _AUTO
    for mapping, cls in order:
        if mt in getattr(A, mapping, {}):
            return getattr(transformers, cls)
    own = own_model_class(config)
    if own is not None:
        return own
    raise ConfigError(
        f"model_type {mt!r} ({type(config).__name__}): no auto class of transformers "
        f"{transformers.__version__} maps it ({', '.join(c for _, c in _AUTO)}) and no "
        f"class of its own modeling module builds this config; build the model in Python and "
        f"pass it to meshlab.plan(model, spec, mesh)")


def own_model_class(config):
    """The model class of a config no auto mapping lists (a sub-config such as a
    multimodal model's text part): the class of the config's modeling module
    (``configuration_x`` -> ``modeling_x``) whose ``config_class`` is this config's class,
    one named ``...ForCausalLM`` first, then ``...Model``, then the only one there is.
    None when the module has none; ``ConfigError`` when it has several, none so named."""
    import importlib

    from transformers import PreTrainedModel

    from ..core.errors import ConfigError

    name = type(config).__module__
    if ".configuration_" not in name:
        return None
    try:
        mod = importlib.import_module(name.replace(".configuration_", ".modeling_"))
    except ImportError:
        return None
    found = [v for k, v in vars(mod).items() if isinstance(v, type)
             and issubclass(v, PreTrainedModel) and getattr(v, "config_class", None)
             is type(config) and not k.endswith("PreTrainedModel")]
    found = list(dict.fromkeys(found))          # aliases of one class count once
    for suffix in ("ForCausalLM", "Model"):
        named = [c for c in found if c.__name__.endswith(suffix)]
        if named:
            return named[0]
    if len(found) > 1:
        raise ConfigError(
            f"model_type {config.model_type!r}: {mod.__name__} has several model classes "
            f"for {type(config).__name__} ({', '.join(c.__name__ for c in found)}) and none "
            f"is its ...ForCausalLM or ...Model; build the one you mean in Python and pass "
            f"it to meshlab.plan(model, spec, mesh)")
    return found[0] if found else None


def from_config(cls, config, **kw):
    """``cls`` built from ``config``: an auto class's ``from_config``, a model class's
    ``_from_config`` (which a transformers model class has in its place)."""
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    return make(config, **kw)
