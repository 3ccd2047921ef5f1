"""Greedy rows take the exact argmax (lowest token id on ties) whatever else shares their batch.

A greedy request batched next to sampled ones rides along the batch's draw at a tiny temperature;
with two tied logits that draw would pick either (issue 31). Checked on the sampler (planted ties,
every filter and seed combination, many RNG states; the oracle is torch.argmax, which returns the
first maximum) and end to end, in the default and the `--deterministic` mode: greedy requests in a
batch with sampled ones give the tokens they give beside greedy ones, and alone (deterministic
mode), on a model whose head makes two tokens tie exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List

import pytest
import torch
from helpers import TEST_DEVICE
from safetensors.torch import load_file, save_file

from minisgl.core import SamplingParams
from minisgl.engine.sample import Sampler
from minisgl.llm import LLM

VOCAB = 256
N_NEW = 6
TIE = (37, 90)  # the crafted head gives these two tokens identical logits
SAMPLED = [
    SamplingParams(temperature=0.7, max_tokens=N_NEW, ignore_eos=True),
    SamplingParams(temperature=1.3, top_k=20, top_p=0.8, seed=11, max_tokens=N_NEW, ignore_eos=True),
    SamplingParams(temperature=1.0, min_p=0.05, seed=5, max_tokens=N_NEW, ignore_eos=True),
]
# greedy requests in different dresses (top_k = 1 is greedy too); the last one is a tie
GREEDY = [
    SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True),
    SamplingParams(temperature=0.0, top_p=0.5, max_tokens=N_NEW, ignore_eos=True),
    SamplingParams(temperature=0.8, top_k=1, max_tokens=N_NEW, ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True, logit_bias={TIE[0]: 100.0, TIE[1]: 100.0}),
]


def _fake_batch(params: List[SamplingParams]) -> Any:
    """What Sampler.prepare reads of a batch: each request's params and its length."""
    return SimpleNamespace(reqs=[SimpleNamespace(sampling_params=p, device_len=10 + i) for i, p in enumerate(params)])


@pytest.mark.parametrize("company", ["temperature", "top_k/top_p", "min_p", "seeded"])
def test_sampler_greedy_rows_take_the_lowest_argmax(company: str) -> None:
    """Logits with the maximum planted 2-4 times per row: the greedy rows always return the lowest
    of those ids, over many RNG states, beside sampled rows that take each sampling path."""
    dev = torch.device(TEST_DEVICE)
    other = {
        "temperature": dict(temperature=1.2),
        "top_k/top_p": dict(temperature=0.8, top_k=8, top_p=0.9),
        "min_p": dict(temperature=1.0, min_p=0.1),
        "seeded": dict(temperature=0.7, seed=3),
    }[company]
    # greedy rows in their dresses too: a greedy row's own top-k = 1 or top-p must not drop the
    # lowest of its tied maxima (a sort puts ties in any order)
    dresses = [dict(temperature=0.0), dict(temperature=0.0, top_p=0.5), dict(temperature=0.9, top_k=1)]
    params = [SamplingParams(**other) if i % 3 else SamplingParams(**dresses[i // 3]) for i in range(9)]
    greedy_rows = [i for i, p in enumerate(params) if p.is_greedy]
    sampler = Sampler(dev, vocab_size=VOCAB)
    args = sampler.prepare(_fake_batch(params))  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        logits = torch.randn(len(params), VOCAB, generator=gen)
        for row in range(len(params)):
            ties = torch.randperm(VOCAB, generator=gen)[: 2 + trial % 3]
            logits[row, ties] = logits[row].max() + 1.0
        want = logits.argmax(dim=-1)  # torch.argmax: the first maximum
        torch.manual_seed(trial)
        for dtype in (torch.float32, torch.bfloat16):
            got = sampler.sample(logits.to(dtype).to(dev), args).cpu()
            assert got[greedy_rows].tolist() == want[greedy_rows].tolist(), f"trial {trial}, {dtype}"


@pytest.fixture(scope="module")
def tie_model(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny llama with the LM-head rows of TIE[1] set to TIE[0]'s: their logits are equal
    bit for bit (the same dot product), so a +100 bias on both makes them the tied maximum."""
    out = tmp_path_factory.mktemp("tie_head")
    for f in tiny_dir.iterdir():
        shutil.copy(f, out / f.name)
    weights = load_file(str(out / "model.safetensors"))
    head = weights["lm_head.weight"]
    head[TIE[1]] = head[TIE[0]]
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _run(llm: LLM, prompts: List[List[int]], params: List[SamplingParams]) -> List[Any]:
    return llm.generate(prompts, params)


@pytest.mark.parametrize("deterministic", [False, True])
def test_greedy_requests_beside_sampled_ones_give_their_greedy_tokens(tie_model: Path, deterministic: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(1, VOCAB, (12,), generator=gen).tolist() for _ in range(len(GREEDY) + len(SAMPLED))]
    g_prompts, s_prompts = prompts[: len(GREEDY)], prompts[len(GREEDY) :]
    llm = LLM(
        str(tie_model), dtype="float32", device=TEST_DEVICE, deterministic=deterministic,
        max_running_req=16, max_seq_len_override=64, num_page_override=16 * 64, cache_type="naive",
    )  # fmt: skip
    try:
        # the same batch shapes with greedy company (its rows' logits are the same bits): the reference
        ref = [o.token_ids for o in _run(llm, g_prompts + s_prompts, GREEDY + [GREEDY[0]] * len(SAMPLED))[: len(GREEDY)]]
        torch.manual_seed(0)
        mixed = _run(llm, g_prompts + s_prompts, GREEDY + SAMPLED)
        assert [o.token_ids for o in mixed[: len(GREEDY)]] == ref
        torch.manual_seed(1)  # the unseeded rows draw otherwise; the company in another order
        company = SAMPLED[1:] + SAMPLED[:1]
        # greedy rows at the even rows, the sampled ones between them (the last greedy row last)
        order = [k // 2 + (0 if k % 2 == 0 else len(GREEDY)) for k in range(2 * len(SAMPLED))] + [len(GREEDY) - 1]
        sps = GREEDY + company
        interleaved = _run(llm, [prompts[i] for i in order], [sps[i] for i in order])
        assert [o.token_ids for o, i in zip(interleaved, order) if i < len(GREEDY)] == ref, "interleaved"
        if deterministic:  # batch-invariant: alone gives the same tokens too (a plain and the tied request)
            for i in (0, len(GREEDY) - 1):
                assert _run(llm, [g_prompts[i]], [GREEDY[i]])[0].token_ids == ref[i], f"greedy request {i} alone"
    finally:
        llm.shutdown()
    # the tied pair outweighs every other token and the lower id wins every step (beside sampled
    # rows too: the comparisons above); before the fix the mixed batches drew either
    assert ref[-1] == [min(TIE)] * N_NEW
