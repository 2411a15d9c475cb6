"""Write a Hugging Face-format checkpoint with random weights, offline and reproducibly.

    python tools/make_tiny_model.py                       # models/tiny-qwen3 (about 3M params)
    python tools/make_tiny_model.py --like qwen3-0.6b     # models/qwen3-0.6b-like (0.6B, bf16)
    python tools/make_tiny_model.py --out DIR --seed 1    # elsewhere, other random weights
    python tools/make_tiny_model.py --arch llama          # models/tiny-llama (also qwen2,
                                                          # qwen3-moe: chapter 18)
    python tools/make_tiny_model.py --like llama-3.2-1b   # Llama-3.2-1B's shape (also qwen3-moe)

The directory holds what a real checkpoint holds: `config.json`, `generation_config.json`,
`model.safetensors`, `tokenizer.json` and `tokenizer_config.json` (with a Qwen3-style chat
template). Every file is a pure function of the arguments: two runs, on any machine, write the
same bytes. The tokenizer and the chat template are read from `tools/assets/`, never retrained.

The tiny model is the Qwen3 architecture at toy size, so everything in the book runs on a CPU in
seconds and can be compared token for token with `transformers`. `--like qwen3-0.6b` gives
Qwen3-0.6B's published shape (random weights, so its text is noise) for GPU benchmarks.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
ASSETS = Path(__file__).resolve().parent / "assets"
TOKENIZER_ASSET = ASSETS / "tokenizer.json"
CHAT_TEMPLATE_ASSET = ASSETS / "chat_template.jinja"

SUPPORTED_ARCHS = ("qwen3", "llama", "qwen2", "qwen3-moe")  # the last three: chapter 18

# Where Qwen3 puts its 26 added tokens; our 0.6b-like tokenizer uses the same ids, so prompts
# and stop tokens look exactly like the real model's.
QWEN3_FIRST_ADDED_ID = 151643


@dataclass(frozen=True)
class ModelShape:
    """The numbers that decide a Qwen3 model's tensors (everything else is fixed)."""

    name: str  # default output directory under models/
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int | None  # None: exactly the committed tokenizer's size
    max_position_embeddings: int
    dtype: str  # how the weights are stored: "float32" or "bfloat16"


TINY_QWEN3 = ModelShape(
    name="tiny-qwen3", hidden_size=256, intermediate_size=512, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=None,
    max_position_embeddings=4096, dtype="float32",
)
# Qwen3-0.6B's published config.json.
QWEN3_0_6B = ModelShape(
    name="qwen3-0.6b-like", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
    num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, dtype="bfloat16",
)


@dataclass(frozen=True)
class Family:
    """What an architecture fixes beyond the shape: names, biases, norms, rotary defaults."""

    architectures: str  # config.json's class name
    model_type: str
    transformers_version: str  # the first release that knows the family
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_theta: float = 1000000.0
    rms_norm_eps: float = 1e-6
    first_added_id: int = QWEN3_FIRST_ADDED_ID  # where a grown vocabulary puts added tokens


@dataclass(frozen=True)
class MoEShape:
    """The experts of a Qwen3-MoE checkpoint."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()  # layers that keep a dense MLP
    norm_topk_prob: bool = True


@dataclass(frozen=True)
class Variant:
    """One checkpoint to write: a family, a shape and the settings that vary between sizes."""

    family: Family
    shape: ModelShape
    tie_word_embeddings: bool = True
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # a dict's items, kept hashable
    moe: MoEShape | None = None


QWEN3 = Family("Qwen3ForCausalLM", "qwen3", "4.51.0", qk_norm=True)
QWEN2 = Family("Qwen2ForCausalLM", "qwen2", "4.43.1", qkv_bias=True)
LLAMA = Family("LlamaForCausalLM", "llama", "4.45.0", rope_theta=500000.0, rms_norm_eps=1e-5,
               first_added_id=128000)  # Llama 3 numbers its special tokens from 128000
QWEN3_MOE = Family("Qwen3MoeForCausalLM", "qwen3_moe", "4.51.0", qk_norm=True)

# Llama 3.1/3.2's long-context RoPE (rope_type llama3), as their config.json has it.
LLAMA3_ROPE = (("factor", 32.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
               ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))
# The same scaling at the tiny model's scale: trained on 1,024 positions, stretched to 4,096.
TINY_LLAMA3_ROPE = (("factor", 4.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                    ("original_max_position_embeddings", 1024), ("rope_type", "llama3"))

TINY = {
    "qwen3": Variant(QWEN3, TINY_QWEN3),
    "qwen2": Variant(QWEN2, replace(TINY_QWEN3, name="tiny-qwen2")),
    # untied and with llama3 RoPE scaling: the tiny Llama covers what the 1B-like one does not
    "llama": Variant(LLAMA, replace(TINY_QWEN3, name="tiny-llama"), tie_word_embeddings=False,
                     rope_scaling=TINY_LLAMA3_ROPE),
    # layer 2 keeps a dense MLP, so dense and sparse layers are mixed
    "qwen3-moe": Variant(QWEN3_MOE, replace(TINY_QWEN3, name="tiny-qwen3-moe"),
                         tie_word_embeddings=False,
                         moe=MoEShape(num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=128, mlp_only_layers=(2,))),
}
# Llama-3.2-1B's published config.json (tied, llama3 RoPE).
LLAMA_3_2_1B = ModelShape(
    name="llama-3.2-1b-like", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
    num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
    max_position_embeddings=131072, dtype="bfloat16",
)
# Qwen3-30B-A3B's published config.json with 4 of its 48 layers: 128 experts, 8 per token,
# and every width as published.
QWEN3_30B_A3B_4L = ModelShape(
    name="qwen3-moe-like", hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
    max_position_embeddings=40960, dtype="bfloat16",
)
LIKE_VARIANTS = {
    "qwen3-0.6b": Variant(QWEN3, QWEN3_0_6B),
    "llama-3.2-1b": Variant(LLAMA, LLAMA_3_2_1B, rope_scaling=LLAMA3_ROPE),
    "qwen3-moe": Variant(QWEN3_MOE, QWEN3_30B_A3B_4L, tie_word_embeddings=False,
                         moe=MoEShape(num_experts=128, num_experts_per_tok=8,
                                      moe_intermediate_size=768)),
}
LIKE = {name: variant.shape for name, variant in LIKE_VARIANTS.items()}


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def load_base_tokenizer_json() -> dict[str, Any]:
    """The committed byte-level BPE (ordinary tokens first, then Qwen3's 26 added tokens)."""
    return json.loads(TOKENIZER_ASSET.read_text(encoding="utf-8"))


def extend_tokenizer_json(base: dict[str, Any], vocab_size: int,
                          first_added_id: int) -> dict[str, Any]:
    """Grow `base` to exactly `vocab_size` ids with the added tokens at `first_added_id`.

    A real checkpoint's embedding may have more rows than its tokenizer has tokens (Qwen3-0.6B:
    151,936 rows), but a server must be able to decode any id a model emits. So every id gets a
    token: new ordinary tokens are concatenations of two base tokens, taken in a fixed order
    (shortest id sums first) and each learned as one more BPE merge. The added tokens move to
    `first_added_id`; they are also entered in the BPE vocabulary at those ids, because the
    tokenizers library numbers added tokens that are missing from the model after the model's
    vocabulary, whatever id the file gives them.
    """
    added = base["added_tokens"]
    vocab: dict[str, int] = dict(base["model"]["vocab"])
    merges: list[list[str]] = [list(m) if isinstance(m, list) else m.split(" ")
                               for m in base["model"]["merges"]]
    ordinary = sorted(vocab, key=vocab.__getitem__)
    if first_added_id < len(ordinary) or first_added_id + len(added) > vocab_size:
        raise ValueError(f"cannot place {len(added)} added tokens at id {first_added_id} in a "
                         f"vocabulary of {vocab_size} with {len(ordinary)} base tokens")

    reserved = {first_added_id + i: tok["content"] for i, tok in enumerate(added)}
    taken = set(vocab) | set(reserved.values())
    free_ids = (i for i in range(len(ordinary), vocab_size) if i not in reserved)

    def new_pairs() -> Iterator[tuple[str, str]]:
        n = len(ordinary)
        for total in range(2 * n - 1):  # pairs (a, b) with a + b == total, a ascending
            for a in range(max(0, total - n + 1), min(total, n - 1) + 1):
                yield ordinary[a], ordinary[total - a]

    pairs = new_pairs()
    for new_id in free_ids:
        for left, right in pairs:
            if left + right not in taken:
                break
        else:
            raise ValueError(f"ran out of token pairs before reaching {vocab_size} ids")
        taken.add(left + right)
        vocab[left + right] = new_id
        merges.append([left, right])

    for new_id, content in reserved.items():
        vocab[content] = new_id
    out = dict(base)
    out["added_tokens"] = [dict(tok, id=first_added_id + i) for i, tok in enumerate(added)]
    out["model"] = dict(base["model"], vocab=dict(sorted(vocab.items(), key=lambda kv: kv[1])),
                        merges=merges)
    return out


def build_tokenizer_json(shape: ModelShape,
                         first_added_id: int = QWEN3_FIRST_ADDED_ID) -> dict[str, Any]:
    """The tokenizer.json contents for `shape`: the committed one, or it grown to the vocab."""
    base = load_base_tokenizer_json()
    if shape.vocab_size is None:
        return base
    return extend_tokenizer_json(base, shape.vocab_size, first_added_id)


def build_tokenizer(shape: ModelShape) -> Tokenizer:
    """The `tokenizers.Tokenizer` that `shape`'s checkpoint ships with."""
    return Tokenizer.from_str(json.dumps(build_tokenizer_json(shape)))


def tokenizer_size(tokenizer_json: dict[str, Any]) -> int:
    """How many ids the tokenizer defines (ordinary and added tokens; the highest id + 1)."""
    ids = list(tokenizer_json["model"]["vocab"].values())
    ids += [tok["id"] for tok in tokenizer_json["added_tokens"]]
    return max(ids) + 1


def added_token_ids(tokenizer_json: dict[str, Any]) -> dict[str, int]:
    """Map each added token ("<|im_end|>", "<think>", ...) to its id."""
    return {tok["content"]: tok["id"] for tok in tokenizer_json["added_tokens"]}


def build_tokenizer_config(tokenizer_json: dict[str, Any], shape: ModelShape) -> dict[str, Any]:
    """tokenizer_config.json: which tokens are special, the chat template, the length limit."""
    added = tokenizer_json["added_tokens"]
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(tok["id"]): {key: tok[key] for key in
                             ("content", "lstrip", "normalized", "rstrip", "single_word",
                              "special")}
            for tok in added
        },
        "additional_special_tokens": [tok["content"] for tok in added
                                      if tok["special"] and tok["content"] != "<|endoftext|>"],
        "bos_token": None,
        # The template file ends with a newline for editors; the template itself does not.
        "chat_template": CHAT_TEMPLATE_ASSET.read_text(encoding="utf-8").rstrip("\n"),
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": shape.max_position_embeddings,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # The generic fast tokenizer loads tokenizer.json exactly as written. (Naming
        # Qwen2Tokenizer would make recent transformers rebuild the pipeline with Qwen's NFC
        # normalizer, and decode(encode(s)) == s would no longer hold for every string.)
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


def build_config(variant: Variant | ModelShape, vocab_size: int, bos_token_id: int,
                 eos_token_id: int) -> dict[str, Any]:
    """config.json for `variant` (a bare shape is a Qwen3), with the keys its family's has."""
    if isinstance(variant, ModelShape):
        variant = Variant(QWEN3, variant)
    shape, family = variant.shape, variant.family
    config: dict[str, Any] = {
        "architectures": [family.architectures],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "hidden_size": shape.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": shape.intermediate_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "model_type": family.model_type,
        "num_attention_heads": shape.num_attention_heads,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_key_value_heads": shape.num_key_value_heads,
        "rms_norm_eps": family.rms_norm_eps,
        "rope_scaling": dict(variant.rope_scaling) if variant.rope_scaling else None,
        "rope_theta": family.rope_theta,
        "tie_word_embeddings": variant.tie_word_embeddings,
        "torch_dtype": shape.dtype,
        # Without any version here, transformers 5.x suspects a Mistral tokenizer and warns
        # about its regex; each family gets the first release that knows it.
        "transformers_version": family.transformers_version,
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    if family.model_type != "qwen2":  # Qwen2 derives head_dim from hidden_size / heads
        config.update(head_dim=shape.head_dim, attention_bias=False)
    elif shape.hidden_size != shape.num_attention_heads * shape.head_dim:
        raise ValueError("a Qwen2 config has no head_dim: hidden_size must be heads * head_dim")
    if family.model_type == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    else:  # the Qwen families' sliding-window keys, switched off as in their releases
        config.update(max_window_layers=shape.num_hidden_layers, sliding_window=None,
                      use_sliding_window=False)
    if variant.moe is not None:
        moe = variant.moe
        config.update(decoder_sparse_step=moe.decoder_sparse_step,
                      mlp_only_layers=list(moe.mlp_only_layers),
                      moe_intermediate_size=moe.moe_intermediate_size,
                      norm_topk_prob=moe.norm_topk_prob, num_experts=moe.num_experts,
                      num_experts_per_tok=moe.num_experts_per_tok, output_router_logits=False,
                      router_aux_loss_coef=0.001)
    return config


def build_generation_config(bos_token_id: int, eos_token_ids: list[int],
                            pad_token_id: int) -> dict[str, Any]:
    """generation_config.json: which tokens end a reply. No sampling defaults, on purpose:
    `transformers`' generate() then decodes greedily, the reference the tests compare to."""
    return {"bos_token_id": bos_token_id, "eos_token_id": eos_token_ids,
            "pad_token_id": pad_token_id}


# ----------------------------------------------------------------------------------------------
# Weights
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, its shape and how to fill it."""

    name: str
    shape: tuple[int, ...]
    init: str  # "matrix": centred noise scaled to the fan-in; "norm": 1 plus a little noise;
    # "bias": a little centred noise

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def sparse_layers(config: dict[str, Any]) -> set[int]:
    """The layers of a Qwen3-MoE config that hold experts (none for a dense model)."""
    if not config.get("num_experts"):
        return set()
    step, dense = config["decoder_sparse_step"], set(config["mlp_only_layers"])
    return {i for i in range(config["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0}


def weight_specs(config: dict[str, Any]) -> list[TensorSpec]:
    """Every tensor of the checkpoint `config` describes, named as Hugging Face names them.

    Qwen2 adds biases to q, k and v; the Qwen3 families add q_norm and k_norm; a sparse layer
    has a router (`mlp.gate`) and one gated MLP per expert; untied checkpoints end with
    `lm_head.weight`.
    """
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size = config["num_attention_heads"] * head_dim
    kv_size = config["num_key_value_heads"] * head_dim
    qkv_bias = config["model_type"] == "qwen2"
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe")
    sparse = sparse_layers(config)
    specs = [TensorSpec("model.embed_tokens.weight", (config["vocab_size"], hidden), "matrix")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (hidden,), "norm"),
            TensorSpec(p + "self_attn.q_proj.weight", (q_size, hidden), "matrix"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv_size, hidden), "matrix"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv_size, hidden), "matrix"),
        ]
        if qkv_bias:
            specs += [TensorSpec(p + f"self_attn.{x}_proj.bias", (size,), "bias")
                      for x, size in (("q", q_size), ("k", kv_size), ("v", kv_size))]
        if qk_norm:
            specs += [TensorSpec(p + "self_attn.q_norm.weight", (head_dim,), "norm"),
                      TensorSpec(p + "self_attn.k_norm.weight", (head_dim,), "norm")]
        specs += [
            TensorSpec(p + "self_attn.o_proj.weight", (hidden, q_size), "matrix"),
            TensorSpec(p + "post_attention_layernorm.weight", (hidden,), "norm"),
        ]
        if i in sparse:
            experts, moe_inter = config["num_experts"], config["moe_intermediate_size"]
            specs.append(TensorSpec(p + "mlp.gate.weight", (experts, hidden), "matrix"))
            for e in range(experts):
                specs += _mlp_specs(f"{p}mlp.experts.{e}.", hidden, moe_inter)
        else:
            specs += _mlp_specs(p + "mlp.", hidden, inter)
    specs.append(TensorSpec("model.norm.weight", (hidden,), "norm"))
    if not config["tie_word_embeddings"]:
        specs.append(TensorSpec("lm_head.weight", (config["vocab_size"], hidden), "matrix"))
    return specs


def _mlp_specs(prefix: str, hidden: int, inter: int) -> list[TensorSpec]:
    return [TensorSpec(prefix + "gate_proj.weight", (inter, hidden), "matrix"),
            TensorSpec(prefix + "up_proj.weight", (inter, hidden), "matrix"),
            TensorSpec(prefix + "down_proj.weight", (hidden, inter), "matrix")]


# Every matrix gets std = MATRIX_GAIN / sqrt(its input width) (the embedding's is the hidden
# size: tied, it is also the LM head). That is several times Hugging Face's initializer_range of
# 0.02, on purpose: at 0.02 the random model's logits are nearly flat (std about 0.3) and greedy
# decoding soon repeats one token forever. At this scale the logits spread out (std about 2),
# greedy text keeps changing, and sampling has a real distribution to work on.
MATRIX_GAIN = 2.0
NORM_NOISE_STD = 0.1  # RMSNorm weights are 1 + this much noise, so the norms are not identities
BIAS_STD = 0.1  # Qwen2's q/k/v biases: small, but far from zero so that a missing bias shows


def portable_normal(numel: int, std: float, generator: torch.Generator) -> torch.Tensor:
    """`numel` float32 samples with mean 0 and standard deviation `std`, bell-shaped.

    Why not torch.randn: its Box-Muller step uses log/sin/cos, whose last bits depend on the
    CPU's vector instructions, so two machines would write different checkpoints. Instead each
    sample is ONE random 30-bit integer read as three 10-bit digits; the sum of three uniform
    digits is already close to a normal curve (the central limit theorem at work). Only exact
    integer steps and one correctly rounded float multiply follow, so the bits are the same on
    every machine. Sample i uses the generator's i-th draw, so generating a big tensor in
    chunks gives exactly the values of generating it whole.
    """
    draws = torch.randint(0, 1 << 30, (numel,), generator=generator, dtype=torch.int32)
    digits_sum = (draws & 1023) + ((draws >> 10) & 1023) + (draws >> 20)
    # Each digit is uniform on 0..1023 (variance (1024^2 - 1) / 12), so 2 * sum - 3 * 1023 is
    # centred with variance 1024^2 - 1, and is an exact integer.
    centred = 2 * digits_sum - 3 * 1023
    return centred.to(torch.float32) * (std / math.sqrt(1024**2 - 1))


def generate_tensor(spec: TensorSpec, dtype: torch.dtype, generator: torch.Generator,
                    chunk_numel: int = 1 << 22) -> Iterator[torch.Tensor]:
    """The values of `spec`, flattened, in chunks of at most `chunk_numel` elements."""
    for start in range(0, spec.numel, chunk_numel):
        n = min(chunk_numel, spec.numel - start)
        if spec.init == "matrix":
            values = portable_normal(n, MATRIX_GAIN / math.sqrt(spec.shape[1]), generator)
        elif spec.init == "norm":
            values = 1.0 + portable_normal(n, NORM_NOISE_STD, generator)
        elif spec.init == "bias":
            values = portable_normal(n, BIAS_STD, generator)
        else:
            raise AssertionError(f"unknown init {spec.init!r} for {spec.name}")
        yield values.to(dtype)


SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def safetensors_header(specs: list[TensorSpec], dtype: torch.dtype) -> bytes:
    """The header of a .safetensors file holding `specs` back to back, in that order.

    The format is an 8-byte little-endian length, then a JSON object mapping each tensor name
    to its dtype, shape and byte range in the data section, then the raw data. Writing it by
    hand lets us stream one tensor at a time (the 0.6B model never sits in memory whole) and
    fixes every byte of the header.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        size = spec.numel * itemsize
        entries[spec.name] = {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(spec.shape),
                              "data_offsets": [offset, offset + size]}
        offset += size
    header = json.dumps(entries, separators=(",", ":")).encode("utf-8")
    header += b" " * (-len(header) % 8)  # pad so the data starts 8-byte aligned
    return len(header).to_bytes(8, "little") + header


def write_weights(path: Path, config: dict[str, Any], seed: int) -> int:
    """Write seeded random weights for `config` to the safetensors file `path`.

    Returns the number of parameters.
    """
    dtype = getattr(torch, config["torch_dtype"])
    specs = weight_specs(config)
    generator = torch.Generator().manual_seed(seed)
    with path.open("wb") as f:
        f.write(safetensors_header(specs, dtype))
        for spec in specs:
            for chunk in generate_tensor(spec, dtype, generator):
                f.write(chunk.view(torch.uint8).numpy().tobytes())
    return sum(spec.numel for spec in specs)


# ----------------------------------------------------------------------------------------------
# The checkpoint directory
# ----------------------------------------------------------------------------------------------


def write_json(path: Path, data: dict[str, Any], sort_keys: bool = True) -> None:
    """Write JSON with fixed formatting (2-space indent, a final newline), so bytes never vary."""
    text = json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False)
    path.write_text(text + "\n", encoding="utf-8")


@dataclass
class CheckpointSummary:
    """What write_checkpoint wrote, for the summary lines."""

    out: Path
    files: list[str]
    num_params: int
    vocab_size: int
    special_ids: dict[str, int]
    weights_bytes: int


def write_checkpoint(out: Path, variant: Variant | ModelShape, seed: int = 0,
                     weights: bool = True) -> CheckpointSummary:
    """Write the whole checkpoint directory for `variant` (a bare shape is a Qwen3) to `out`.

    With `weights=False` everything but model.safetensors is written (quick, for checking a
    large shape's config and tokenizer).
    """
    if isinstance(variant, ModelShape):
        variant = Variant(QWEN3, variant)
    shape = variant.shape
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = build_tokenizer_json(shape, variant.family.first_added_id)
    vocab_size = tokenizer_size(tokenizer_json)
    if shape.vocab_size is not None and vocab_size != shape.vocab_size:
        raise AssertionError(f"tokenizer has {vocab_size} ids, shape wants {shape.vocab_size}")
    ids = added_token_ids(tokenizer_json)
    endoftext, im_end = ids["<|endoftext|>"], ids["<|im_end|>"]

    config = build_config(variant, vocab_size, bos_token_id=endoftext, eos_token_id=im_end)
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json",
               build_generation_config(endoftext, [im_end, endoftext], endoftext))
    # tokenizer.json keeps the tokenizers library's key order (vocab in id order) to stay
    # readable; its order is already fixed by the asset and the code above.
    write_json(out / "tokenizer.json", tokenizer_json, sort_keys=False)
    write_json(out / "tokenizer_config.json", build_tokenizer_config(tokenizer_json, shape))
    files = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"]

    num_params = sum(spec.numel for spec in weight_specs(config))
    weights_bytes = 0
    if weights:
        write_weights(out / "model.safetensors", config, seed)
        files.insert(2, "model.safetensors")
        weights_bytes = (out / "model.safetensors").stat().st_size
    else:
        # A stale weights file from an earlier run would not match this config.
        (out / "model.safetensors").unlink(missing_ok=True)
    special = {name: ids[name] for name in ("<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                            "<think>", "</think>")}
    return CheckpointSummary(out, files, num_params, vocab_size, special, weights_bytes)


# ----------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line (the docs' Reference page renders its help from here)."""
    parser = argparse.ArgumentParser(
        prog="make_tiny_model.py",
        description="Write a Qwen3, Llama, Qwen2 or Qwen3-MoE checkpoint with seeded random "
                    "weights (offline, deterministic).")
    parser.add_argument("--out", type=Path, default=None,
                        help="output directory (default: models/tiny-<arch>, or "
                             "models/<like>-like with --like)")
    parser.add_argument("--arch", default=None,
                        help=f"model architecture: {', '.join(SUPPORTED_ARCHS)} (default: "
                             "qwen3, or the family of --like)")
    parser.add_argument("--like", default=None,
                        help=f"copy a real model's shape instead of the tiny one: "
                             f"{', '.join(LIKE)}")
    parser.add_argument("--seed", type=int, default=0, help="random seed for the weights")
    parser.add_argument("--no-weights", action="store_true",
                        help="write config and tokenizer files only (no model.safetensors)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parse and validate the command line (argparse exits with status 2 on errors)."""
    parser = build_parser()
    args = parser.parse_args(argv)

    if args.arch is not None and args.arch not in SUPPORTED_ARCHS:
        parser.error(f"unknown architecture {args.arch!r}; choose from "
                     f"{', '.join(SUPPORTED_ARCHS)}")
    if args.like is not None and args.like not in LIKE:
        parser.error(f"unknown --like {args.like!r}; choose from {', '.join(LIKE)}")
    if args.like is not None and args.arch is not None:
        like_family = LIKE_VARIANTS[args.like].family
        if like_family is not TINY[args.arch].family:
            parser.error(f"--like {args.like} is a {like_family.architectures}, not --arch "
                         f"{args.arch}; leave --arch out")
    if args.seed < 0:
        parser.error(f"--seed must be >= 0, got {args.seed}")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} exists and is not a directory")
    return args


def display_path(path: Path) -> str:
    """`path` relative to the current directory when it is inside it (shorter, and the same on
    every machine), else as given."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: write the checkpoint and print what was written."""
    args = parse_args(argv)
    variant = LIKE_VARIANTS[args.like] if args.like else TINY[args.arch or "qwen3"]
    shape = variant.shape
    out = args.out if args.out is not None else ROOT / "models" / shape.name
    print(f"writing {shape.name} ({variant.family.architectures}, {shape.dtype}, "
          f"seed {args.seed}) to {display_path(out)}")
    start = time.perf_counter()
    summary = write_checkpoint(out, variant, seed=args.seed, weights=not args.no_weights)
    elapsed = time.perf_counter() - start

    print(f"  layers {shape.num_hidden_layers}, hidden {shape.hidden_size}, "
          f"heads {shape.num_attention_heads} q / {shape.num_key_value_heads} kv "
          f"x {shape.head_dim}, intermediate {shape.intermediate_size}")
    if variant.moe is not None:
        moe = variant.moe
        print(f"  experts {moe.num_experts}, {moe.num_experts_per_tok} per token, "
              f"intermediate {moe.moe_intermediate_size}; dense layers "
              f"{list(moe.mlp_only_layers) or 'none'}")
    print(f"  vocab {summary.vocab_size}: " + ", ".join(
        f"{name} {i}" for name, i in summary.special_ids.items()))
    size = (f"{summary.weights_bytes / 2**20:.1f} MiB" if summary.weights_bytes
            else "not written (--no-weights)")
    print(f"  {summary.num_params:,} parameters; model.safetensors {size}")
    print(f"  files: {', '.join(summary.files)}")
    print(f"done in {elapsed:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
