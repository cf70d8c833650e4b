"""A tiny random-weight llama model in GGUF, written by the tests (needs the ``gguf`` package).

It speaks nonsense: it exists so that a real OpenAI-compatible server (llama-cpp-python's)
can be started in the suite and the agent's requests checked against that server's own
request schema, with no model downloaded from anywhere.  Byte-fallback tokenizer (any text
tokenizes), a ChatML template, one transformer block of width 64 (~300 KB).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_tiny_model(path: Path, *, seed: int = 0) -> Path:
    import gguf  # noqa: PLC0415  (optional: the test is skipped without it)

    rng = np.random.default_rng(seed)
    n_embd, n_ff, n_head, n_ctx = 64, 128, 4, 8192
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", *[f"<0x{i:02X}>" for i in range(256)], "▁"]
    types = [2, 3, 3, 4, 4, *[6] * 256, 1]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("riverbed-tiny-random")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(1)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(n_embd // n_head)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    ones = np.ones(n_embd, dtype=np.float32)
    writer.add_tensor("token_embd.weight", weights(len(tokens), n_embd))
    writer.add_tensor("output_norm.weight", ones)
    writer.add_tensor("output.weight", weights(len(tokens), n_embd))
    writer.add_tensor("blk.0.attn_norm.weight", ones)
    for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
        writer.add_tensor(f"blk.0.{name}.weight", weights(n_embd, n_embd))
    writer.add_tensor("blk.0.ffn_norm.weight", ones)
    writer.add_tensor("blk.0.ffn_gate.weight", weights(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_up.weight", weights(n_ff, n_embd))
    writer.add_tensor("blk.0.ffn_down.weight", weights(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":  # python tinyllm.py PATH (the server's interpreter has gguf; the suite's may not)
    import sys

    write_tiny_model(Path(sys.argv[1]))
