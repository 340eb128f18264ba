"""``meshlab generate``: serve prompts from a local Hugging Face directory with the engine.

    meshlab generate ./my-model --prompt "Once upon a time" --max-new-tokens 32
    meshlab run --nproc-per-node 2 -m meshlab.cli generate ./my-model --prompt "..."

Under a launcher (``WORLD_SIZE`` > 1) the model is tensor-parallel over every process
(``shard(policies.auto)``), and rank 0 prints. A meshlab DCP checkpoint is exported to such
a directory first with ``meshlab.checkpoint.save_pretrained``.
"""

from __future__ import annotations

import json
import os
import sys


def add_command(sub) -> None:
    g = sub.add_parser("generate", help="generate from a local Hugging Face model directory "
                                        "with meshlab.inference (tensor-parallel under a "
                                        "launcher)")
    g.add_argument("path", help="a directory with config.json and safetensors weights")
    g.add_argument("--prompt", action="append", default=[],
                   help="a prompt (repeat for several); needs the directory's tokenizer")
    g.add_argument("--prompt-ids", action="append", default=[],
                   help="a prompt as comma-separated token ids (repeatable)")
    g.add_argument("--max-new-tokens", type=int, default=32)
    g.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (default fp32)")
    g.add_argument("--do-sample", action="store_true")
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-batch-size", type=int, default=8)
    g.add_argument("--prompt-template", default=None,
                   help="'chat' (the tokenizer's chat template) or a format string with "
                        "{input_text}, applied to each --prompt")
    g.add_argument("--json", action="store_true", help="print the outputs as JSON")
    g.set_defaults(fn=cmd_generate)


def cmd_generate(args) -> int:
    import torch

    from ..core.errors import ConfigError
    from ..inference._config import _dtype

    dtype = _dtype(args.dtype, "dtype")
    _check_flags(args)
    prompts = list(args.prompt) + [_ids(p) for p in args.prompt_ids]
    if not prompts:
        raise ConfigError("meshlab generate: give --prompt TEXT or --prompt-ids 1,2,3")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    started = False
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
            started = True
    try:
        return _generate(args, prompts, world, dtype)
    finally:
        if started:     # every rank done before any closes its connections, then destroyed
            from ..core.mesh import _shutdown

            _shutdown()


def _ids(text: str) -> list[int]:
    """``--prompt-ids 1,2,3`` as token ids."""
    from ..core.errors import ConfigError

    parts = [t.strip() for t in text.split(",")]
    if not all(t.isascii() and t.isdigit() for t in parts):
        raise ConfigError(f"--prompt-ids {text!r}: comma-separated token ids (integers >= 0), "
                          f"e.g. --prompt-ids 1,2,3")
    return [int(t) for t in parts]


def _check_flags(args) -> None:
    """The sampling and size flags, refused by name before the model is loaded (what
    InferenceConfig would refuse after it)."""
    import math

    from ..core.errors import ConfigError

    def fail(flag, value, rule, example):
        raise ConfigError(f"{flag} {value!r}: {rule}; pass e.g. {flag} {example}")

    for flag, value in (("--max-new-tokens", args.max_new_tokens),
                        ("--max-batch-size", args.max_batch_size)):
        if value < 1:
            fail(flag, value, "must be an integer >= 1", 8)
    if args.top_k < 0:
        fail("--top-k", args.top_k, "must be an integer >= 0 (0: off)", 50)
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        fail("--temperature", args.temperature, "must be a finite number > 0 (greedy "
             "decoding: leave out --do-sample)", 0.7)
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        fail("--top-p", args.top_p, "is a probability in (0, 1] (1.0: off)", 0.9)


def _generate(args, prompts, world: int, dtype) -> int:
    from ..core.errors import ConfigError
    from ..inference import InferenceConfig, InferenceEngine
    from ..inference._load import load_pretrained

    model, tok = load_pretrained(args.path, dtype)
    if args.prompt and tok is None:
        raise ConfigError(f"meshlab generate: {args.path} has no tokenizer; give the prompts "
                          f"as --prompt-ids")
    if args.prompt_template is not None and args.prompt_ids:
        raise ConfigError("meshlab generate: --prompt-template applies to --prompt text; "
                          "give the --prompt-ids already templated, or the prompts as text")
    from ..inference._engine import _templated

    longest = max(len(_templated(tok, args.prompt_template, p)) if isinstance(p, str)
                  else len(p) for p in prompts)
    cfg = InferenceConfig(dtype=dtype, tp_size=world, max_batch_size=args.max_batch_size,
                          max_input_len=max(longest, 1), max_output_len=args.max_new_tokens,
                          do_sample=args.do_sample, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p,
                          prompt_template=args.prompt_template)
    engine = InferenceEngine(model, tok, cfg)
    text = [p for p in prompts if isinstance(p, str)]
    ids = [p for p in prompts if not isinstance(p, str)]
    outs = (engine.generate(prompts=text, max_new_tokens=args.max_new_tokens) if text else []) \
        + (engine.generate(prompts=ids, max_new_tokens=args.max_new_tokens) if ids else [])
    if int(os.environ.get("RANK", "0")) == 0:
        if args.json:
            print(json.dumps([{"prompt": p, "output": o} for p, o in zip(text + ids, outs)]))
        else:
            for p, o in zip(text + ids, outs):
                print(f"{p!r} -> {o!r}")
        sys.stdout.flush()
    return 0
