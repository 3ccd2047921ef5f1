"""Drive the Engine by hand, with no scheduler: one prefill, then decode steps, on the embedded
SmolLM2-135M-Instruct in float32; compare every prompt with Hugging Face generate.

We play the scheduler ourselves: give each request a range of KV slots (write its page-table
row), fill the batch's input_ids / positions / out_loc each step, call forward_batch, and append
the sampled token to the request. Exits non-zero when a prompt does not match HF.

    python examples/engine_manual.py
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl.core import Batch, Req, SamplingParams
from minisgl.distributed import DistributedInfo
from minisgl.engine import Engine, EngineConfig
from minisgl.utils.hf import resolve_model_path

NEW_TOKENS = 8
TIE_EPS = 1e-4  # a divergence is forgiven only where HF's own top-2 logit gap is below this

path = resolve_model_path(None)  # the embedded model, converted from its GGUF once and cached
engine = Engine(
    EngineConfig(
        model_path=path,
        tp_info=DistributedInfo(0, 1),
        dtype=torch.float32,
        max_running_req=4,
        num_page_override=1024,
        max_seq_len_override=256,
    )
)
print(
    f"device {engine.device}, attention backend {engine.config.attention_backend}, "
    f"KV pool {engine.num_pages} pages, page table {tuple(engine.page_table.shape)}"
)

tok = AutoTokenizer.from_pretrained(path)
prompts = ["The capital of France is", "def fibonacci(n):"]
reqs = []
for row, p in enumerate(prompts):
    ids = tok(p).input_ids
    engine.page_table[row, :256] = torch.arange(row * 256, row * 256 + 256)  # "allocate" KV slots by hand
    reqs.append(
        Req(
            input_ids=torch.tensor(ids, dtype=torch.int32),
            table_idx=row,
            cached_len=0,
            output_len=NEW_TOKENS,
            uid=row,
            sampling_params=SamplingParams(max_tokens=NEW_TOKENS),
            cache_handle=None,
        )
    )

outs: list[list[int]] = [[] for _ in reqs]
phase = "prefill"
for step in range(NEW_TOKENS):
    batch = Batch(reqs=reqs, phase=phase)
    engine.graph_runner.pad_batch(batch)
    # built on the host, as in the seed: forward_batch moves them to the engine's device
    batch.positions = torch.cat([torch.arange(r.cached_len, r.device_len) for r in reqs]).int()
    batch.input_ids = torch.cat([r.input_ids[r.cached_len : r.device_len] for r in reqs])
    batch.out_loc = torch.cat([engine.page_table[r.table_idx, r.cached_len : r.device_len] for r in reqs])
    engine.attn_backend.prepare_metadata(batch)
    out = engine.forward_batch(batch, engine.sampler.prepare(batch))  # forward + sample; advances each Req
    out.copy_done_event.synchronize()
    for i, r in enumerate(reqs):
        r.append_host(out.next_tokens_cpu[i : i + 1])
        outs[i].append(int(out.next_tokens_cpu[i]))
    if step == 0:
        print(f"prefill fed {len(batch.input_ids)} tokens; each decode step feeds {len(reqs)}")
    phase = "decode"
engine.shutdown()

hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(engine.device).eval()
eos = hf.generation_config.eos_token_id
ok = True
for p, o in zip(prompts, outs):
    ids = tok(p, return_tensors="pt").input_ids.to(engine.device)
    gen = hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    ref = gen.sequences[0, ids.shape[1] :].tolist()
    if eos in ref:  # HF stops at EOS; compare up to and including it
        ref = ref[: ref.index(eos) + 1]
    match = o[: len(ref)] == ref
    note = ""
    if not match:
        i = next(i for i, (a, b) in enumerate(zip(o, ref)) if a != b)
        gap = abs(float(gen.logits[i][0, ref[i]] - gen.logits[i][0, o[i]]))
        match = gap < TIE_EPS
        note = f" (tie at token {i}: HF logit gap {gap:.2g})" if match else f" (differs at token {i})"
    ok &= match
    print(f"{p!r}: {tok.decode(o)!r}  matches HF: {match}{note}")
sys.exit(0 if ok else 1)
