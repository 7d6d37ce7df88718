"""Build a tiny random-weight Llama model with its own tokenizer and chat template.

Nothing is downloaded: the tokenizer is a byte-level BPE trained here on generated sentences, the
weights are random. The text it generates is noise, which is fine: this model exists so that a
real vLLM has real token counts, real KV blocks, real preemptions and real metrics.

Two steps, so that what needs no torch never waits for the vLLM environment:

    python harness/tiny_model.py config DIR    # tokenizer, config.json, generation_config.json
    python harness/tiny_model.py slide DIR V   # config.json: variant V (tiny_model.VARIANTS)
    python harness/tiny_model.py weights DIR   # model.safetensors for DIR's config.json

``config`` needs only ``tokenizers`` and ``transformers`` (the sidecar's own dependencies: the
project's venv runs it); ``weights`` needs torch (the vLLM venv runs it). ``weights`` reads the
``config.json`` that ``config`` wrote and adds the weights file only, so the tokenizer and the
config a unit test sees are byte for byte those the real vLLM serves. ``harness.vllm_cpu``
(``ensure_tokenizer_model``, ``ensure_model``) runs both and caches the result.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

VOCAB_SIZE = 512
#: 2 layers x 2 KV heads x head_dim 64 x bf16 x (K, V) = 1,024 bytes per token.
MODEL = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTools:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "<|end|>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if message.get('tool_calls') %}{% for call in message['tool_calls'] %}"
    "<|call|>{{ call['function']['name'] }}({{ call['function']['arguments'] }})"
    "{% endfor %}{% endif %}"
    "<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WORDS = (
    "the a cache block token request model server queue memory budget prompt answer stream "
    "decode prefill batch engine gpu kernel layer head value key vector pool free full "
    "admit refuse retry wait fast slow long short one two three four five six seven eight nine "
    "ten hundred thousand user system assistant tool call reply please thanks hello world data "
    "metric scrape gauge counter histogram pod node cluster service deploy rollout"
).split()


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(4, 16))]
        if rng.random() < 0.3:
            words.insert(rng.randint(0, len(words)), str(rng.randint(0, 10000)))
        lines.append(" ".join(words).capitalize() + rng.choice([".", "?", "!", ","]))
    return lines


def build_tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [
        "<|bos|>",
        "<|eos|>",
        "<|pad|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|tool|>",
        "<|end|>",
        "<|call|>",
    ]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus(4000), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=specials[3:],
        model_max_length=MODEL["max_position_embeddings"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


def config_for(vocab_size: int, bos: int, eos: int) -> Any:
    """The model's ``LlamaConfig`` (no torch needed)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=eos,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
        architectures=["LlamaForCausalLM"],
        **MODEL,
    )


def build_config(out: Path) -> None:
    """``config.json`` and ``generation_config.json`` for the tokenizer already in ``out``."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(out)
    config = config_for(len(tok), tok.bos_token_id, tok.eos_token_id)
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    # save_pretrained writes `dtype` in new transformers; keep `torch_dtype` too for old readers.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


#: the variants with sliding-window layers (``harness.vllm_cpu.ensure_model(variant=...)``), the
#: same tokenizer and layer sizes: ``sliding``, a Mistral model whose every layer attends to the
#: last 256 tokens; ``mixed``, a Gemma 2 model whose layers alternate such a window with full
#: attention (vLLM's hybrid allocator: a sliding group and a full one); ``hybrid``, a Qwen3-Next
#: model (a small mixture of experts) whose first three of four layers are gated delta-net linear
#: attention, a recurrent state (vLLM's ``MambaSpec``), and the fourth full attention;
#: ``chunked``, a Llama 4 text model whose first three of four layers attend within chunks of 256
#: tokens (chunked local attention) and the fourth to everything; ``falcon``, a Falcon-H1 model
#: whose two layers each run an attention branch beside a Mamba 2 one; ``zamba``, a Zamba2 model
#: of four Mamba 2 layers, the second and fourth running the shared attention block too
VARIANTS: dict[str, dict[str, Any]] = {
    "sliding": dict(
        model_type="mistral",
        architectures=["MistralForCausalLM"],
        sliding_window=256,
        max_position_embeddings=4096,
    ),
    "hybrid": dict(
        model_type="qwen3_next",
        architectures=["Qwen3NextForCausalLM"],
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_hidden_layers=4,
        full_attention_interval=4,
        max_position_embeddings=4096,
        linear_num_value_heads=4,
        linear_num_key_heads=2,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        partial_rotary_factor=0.25,
    ),
    "chunked": dict(
        model_type="llama4_text",
        architectures=["Llama4ForCausalLM"],
        num_hidden_layers=4,
        attention_chunk_size=256,
        no_rope_layers=[1, 1, 1, 0],
        layer_types=["chunked_attention"] * 3 + ["full_attention"],
        max_position_embeddings=4096,
        intermediate_size_mlp=512,
        num_local_experts=2,
        num_experts_per_tok=1,
        interleave_moe_layer_step=1,
    ),
    "falcon": dict(
        model_type="falcon_h1",
        architectures=["FalconH1ForCausalLM"],
        max_position_embeddings=4096,
        mamba_d_ssm=256,
        mamba_n_heads=4,
        mamba_d_head=64,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=1,
        mamba_chunk_size=64,
    ),
    "zamba": dict(
        model_type="zamba2",
        architectures=["Zamba2ForCausalLM"],
        num_hidden_layers=4,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        hybrid_layer_ids=[1, 3],
        num_key_value_heads=4,
        head_dim=128,  # the shared attention's, on twice the hidden size (as attention_head_dim)
        attention_head_dim=128,
        hidden_act="gelu",  # vLLM's Zamba2 MLP supports only GELU
        max_position_embeddings=4096,
        num_mem_blocks=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_ngroups=1,
        mamba_headdim=64,
        n_mamba_heads=8,
        chunk_size=64,
        use_shared_attention_adapter=False,
        use_mem_rope=True,
    ),
    "mixed": dict(
        model_type="gemma2",
        architectures=["Gemma2ForCausalLM"],
        sliding_window=256,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
        query_pre_attn_scalar=64,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
}


def slide(model_dir: Path, variant: str) -> None:
    """Turn ``model_dir``'s config (written by ``config``) into ``variant``'s."""
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(VARIANTS[variant])
    if variant == "mixed":
        cfg.pop("hidden_act", None)  # Llama's name; Gemma 2 reads hidden_activation
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build_weights(model_dir: Path) -> None:
    """Random bf16 weights for ``model_dir/config.json``; nothing else in the directory changes."""
    import tempfile

    import torch
    from transformers import (
        FalconH1Config,
        FalconH1ForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        Llama4ForCausalLM,
        Llama4TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
        Zamba2Config,
        Zamba2ForCausalLM,
    )

    torch.manual_seed(0)
    kind = json.loads((model_dir / "config.json").read_text()).get("model_type")
    model: Any
    if kind == "mistral":  # the variants
        model = MistralForCausalLM(MistralConfig.from_pretrained(model_dir))
    elif kind == "gemma2":
        model = Gemma2ForCausalLM(Gemma2Config.from_pretrained(model_dir))
    elif kind == "llama4_text":
        model = Llama4ForCausalLM(Llama4TextConfig.from_pretrained(model_dir))
    elif kind == "falcon_h1":
        model = FalconH1ForCausalLM(FalconH1Config.from_pretrained(model_dir))
    elif kind == "zamba2":
        model = Zamba2ForCausalLM(Zamba2Config.from_pretrained(model_dir))
    elif kind == "qwen3_next":
        model = Qwen3NextForCausalLM(Qwen3NextConfig.from_pretrained(model_dir))
    else:
        model = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir))
    model = model.to(torch.bfloat16)
    with tempfile.TemporaryDirectory(dir=model_dir.parent) as scratch:
        model.save_pretrained(scratch, safe_serialization=True)
        written = sorted(Path(scratch).glob("model*.safetensors*"))
        if not written:
            raise RuntimeError(f"save_pretrained wrote no safetensors in {scratch}")
        for path in written:  # model.safetensors (and an index, were it ever sharded)
            path.rename(model_dir / path.name)


def main(argv: list[str]) -> int:
    if not (
        (len(argv) == 2 and argv[0] in ("config", "weights"))
        or (len(argv) == 3 and argv[0] == "slide" and argv[2] in VARIANTS)
    ):
        print(
            f"usage: tiny_model.py {{config|weights}} DIR | slide DIR {{{'|'.join(VARIANTS)}}}",
            file=sys.stderr,
        )
        return 2
    out = Path(argv[1])
    if argv[0] == "config":
        out.mkdir(parents=True, exist_ok=True)
        build_tokenizer(out)
        build_config(out)
        print(f"tokenizer and config written to {out}")
    elif argv[0] == "slide":
        slide(out, argv[2])
        print(f"the {argv[2]} variant's config written to {out}")
    else:
        build_weights(out)
        print(f"weights written to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
