"""The inference engine's host work per greedy decode step, on this CPU, with the model's
forward taken out: what the host must do between two replays of a captured decode step
(fill the step's inputs, copy them, call the replay, read the tokens a step later,
append them, retire finished requests).

The engine runs its decode steps through ``DecodeGraphs(capture=False)`` -- the same
static buffers and one-step-ahead launches as the CUDA graphs -- and the step's forward
is replaced by writing zeros as the logits and arg-max, so nothing of the model's cost is
left. A GPU step that takes longer than this keeps the GPU fed; one shorter leaves it
idle for the difference. Per ``--batches``: one warm-up generate, then the median over
``--rounds`` generates of ``--new`` tokens, divided by the tokens per request. Writes
``benchmarks/results/engine_host_<tag>.json``, the tag defaulting to the host name.

    python benchmarks/engine_host.py [--batches 1,8,64] [--new 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _results  # noqa: E402
from meshlab.inference import InferenceConfig, InferenceEngine  # noqa: E402
from meshlab.inference._graphs import DecodeGraphs  # noqa: E402

VOCAB = 97


def engine(batch: int, new: int) -> InferenceEngine:
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    eng = InferenceEngine(model, inference_config=InferenceConfig(
        dtype=torch.float32, max_batch_size=batch, max_input_len=8, max_output_len=new,
        block_size=16, ignore_eos=True))
    graphs = DecodeGraphs(eng, capture=False)

    def forward(b):                     # the step's outputs, without the model
        n = b["ids"].shape[1]
        best = torch.zeros(n, dtype=torch.long)
        graphs.last[:n].copy_(best)
        return torch.zeros(n, VOCAB), best

    graphs._forward = forward
    eng.graphs = graphs
    return eng


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,64")
    p.add_argument("--new", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--tag", default=socket.gethostname())
    args = p.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in (int(x) for x in args.batches.split(",")):
        eng = engine(batch, args.new)
        prompts = [[1, 2, 3]] * batch
        eng.generate(prompts=prompts, max_new_tokens=args.new)
        took = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            out = eng.generate(prompts=prompts, max_new_tokens=args.new)
            took.append((time.perf_counter() - t) / args.new)
        assert all(len(o) == args.new for o in out)
        rows.append({"batch": batch, "host_us_per_step": statistics.median(took) * 1e6,
                     "rounds_us": [x * 1e6 for x in took]})
        print(f"batch {batch:4d}: {rows[-1]['host_us_per_step']:8.1f} us of host work per "
              f"decode step", flush=True)
    out = _results.cpu_run(
        "engine_host", transformers=transformers.__version__, new_tokens=args.new,
        timer="time.perf_counter around generate, median of rounds after a warm-up, over "
              "the tokens per request; the prefill (one tiny forward) included",
        results=rows)
    path = _results.write_cpu("engine_host", args.tag, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
