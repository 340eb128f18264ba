import os, sys, torch, time
sys.path.insert(0, ".")
import torch.distributed as dist
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29671")
dist.init_process_group("nccl", rank=0, world_size=1)
import transformers, meshlab as ml
from transformers.integrations import moe
common = dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000, max_position_embeddings=2048, attn_implementation="sdpa", use_cache=False, tie_word_embeddings=False)
cfg = transformers.MixtralConfig(intermediate_size=2816, num_local_experts=8, num_experts_per_tok=2, **common)
with torch.device("cuda"):
    m = transformers.MixtralForCausalLM(cfg).to(torch.bfloat16)
e = m.model.layers[0].mlp.experts
print("default impl", repr(m.config._experts_implementation), repr(e.config._experts_implementation), e.config is m.config)
m.config._experts_implementation = "grouped_mm"
print("set", repr(e.config._experts_implementation))
calls = {"fallback": 0, "grouped": 0}
orig_fb = moe._grouped_mm_fallback if hasattr(moe, "_grouped_mm_fallback") else None
orig_can = moe._can_use_grouped_mm
def can(*a, **k):
    r = orig_can(*a, **k); calls["grouped" if r else "fallback"] += 1; return r
moe._can_use_grouped_mm = can
ids = torch.randint(0, 32000, (4, 2048), device="cuda")
def run(model, n=5):
    for _ in range(2):
        model(input_ids=ids).logits.float().mean().backward()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n):
        model(input_ids=ids).logits.float().mean().backward()
    torch.cuda.synchronize(); return (time.perf_counter() - t) / n * 1e3
print("hf ms", run(m), calls)
calls.update(fallback=0, grouped=0)
m = ml.parallelize(m, ml.expert_route("ep"), ml.Mesh(ep=1), seed=0)
e = m.model.layers[0].mlp.experts
print("meshlab impl", e._meshlab_ep.impl, e.config._experts_implementation)
print("meshlab ms", run(m), calls)
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    m(input_ids=ids).logits.float().mean().backward(); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
