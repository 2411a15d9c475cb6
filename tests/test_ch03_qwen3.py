"""Chapter 3: Qwen3 built from our layers gives transformers' logits, from the same checkpoint.

Most tests use small random checkpoints that transformers itself writes (``save_pretrained``)
into a temporary directory, so they need no tokenizer and can be edited freely (a tensor
removed, one added, the file split in two). The prompt test uses tiny-qwen3 and its tokenizer.
Relative error is ``max |ours - reference| / max |reference|`` over all logits.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

import minisgl.models.weight as weight_module
from minisgl.layers.attention import (
    DenseCausalAttention,
    get_attention_backend,
    use_attention_backend,
)
from minisgl.models import load_model
from minisgl.models.base import BaseLLMModel
from minisgl.models.register import get_model_class, supported_architectures
from minisgl.models.weight import CheckpointMismatchError, checkpoint_files

REL_TOL = 1e-4
PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "<|im_start|>user\nWhy is the sky blue?<|im_end|>\n<|im_start|>assistant\n",
]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape, f"shape {tuple(ours.shape)} != reference {tuple(ref.shape)}"
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def write_random_qwen3(out: Path, tie: bool = True, seed: int = 0) -> Path:
    """A tiny-qwen3-shaped checkpoint written by transformers, with well-spread random weights."""
    config = Qwen3Config(
        hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, vocab_size=2048, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # default init has all norms at 1 and tiny weights: too easy to match
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_qwen3(tmp_path_factory.mktemp("qwen3-tied"))


@pytest.fixture(scope="module")
def hf_model(random_ckpt: Path) -> Qwen3ForCausalLM:
    return AutoModelForCausalLM.from_pretrained(random_ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def our_model(random_ckpt: Path) -> BaseLLMModel:
    return load_model(random_ckpt, device="cpu", dtype="float32", progress=False)


@pytest.fixture
def edit_checkpoint(random_ckpt: Path, tmp_path: Path) -> Callable[..., Path]:
    """Copy the random checkpoint and rewrite its tensors with ``edit(state_dict)``."""
    def make(edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
        out = tmp_path / "edited"
        shutil.copytree(random_ckpt, out)
        tensors = load_file(out / "model.safetensors")
        edit(tensors)
        save_file(tensors, out / "model.safetensors")
        return out
    return make


@torch.inference_mode()
def reference_logits(hf: torch.nn.Module, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    positions = torch.arange(start, start + len(ids))[None]
    return hf(ids[None], position_ids=positions).logits[0]


@torch.inference_mode()
def our_logits(model: BaseLLMModel, ids: torch.Tensor, start: int = 0,
               logits_indices: torch.Tensor | None = None) -> torch.Tensor:
    return model(ids, torch.arange(start, start + len(ids)), logits_indices)


# ---------------------------------------------------------------- logits against transformers


def test_tiny_qwen3_logits_match_transformers_on_prompts(tiny_model_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    ours = load_model(tiny_model_dir, device="cpu", progress=False)
    for prompt in PROMPTS:
        ids = torch.tensor(tokenizer.encode(prompt))
        err = rel_err(our_logits(ours, ids), reference_logits(hf, ids))
        assert err <= REL_TOL, f"prompt {prompt!r}: relative error {err:.2e} > {REL_TOL}"


@pytest.mark.parametrize("num_tokens", [1, 7, 200])
def test_random_checkpoint_logits_match_transformers(
    our_model: BaseLLMModel, hf_model: torch.nn.Module, num_tokens: int
) -> None:
    ids = torch.randint(0, 2048, (num_tokens,))
    logits = our_logits(our_model, ids)
    assert logits.dtype == torch.float32 and logits.shape == (num_tokens, 2048)
    assert rel_err(logits, reference_logits(hf_model, ids)) <= REL_TOL


def test_positions_are_honoured_not_assumed_to_be_0_to_t(
    our_model: BaseLLMModel, hf_model: torch.nn.Module
) -> None:
    ids = torch.randint(0, 2048, (9,))
    gapped = torch.tensor([0, 1, 2, 3, 40, 41, 42, 43, 44])
    with torch.inference_mode():
        ours = our_model(ids, gapped)
        ref = hf_model(ids[None], position_ids=gapped[None]).logits[0]
    assert rel_err(ours, ref) <= REL_TOL
    assert rel_err(ours, our_logits(our_model, ids)) > 1e-3, "positions must change the result"


def test_shifting_every_position_changes_nothing_because_rope_is_relative(
    our_model: BaseLLMModel, hf_model: torch.nn.Module
) -> None:
    ids = torch.randint(0, 2048, (9,))
    shifted = our_logits(our_model, ids, start=100)
    assert rel_err(shifted, reference_logits(hf_model, ids, start=100)) <= REL_TOL
    assert rel_err(shifted, our_logits(our_model, ids)) <= REL_TOL


def test_logits_indices_select_rows_before_the_lm_head(our_model: BaseLLMModel) -> None:
    ids = torch.randint(0, 2048, (10,))
    full = our_logits(our_model, ids)
    rows = torch.tensor([9, 0, 4])
    picked = our_logits(our_model, ids, logits_indices=rows)
    assert picked.shape == (3, 2048)
    assert torch.allclose(picked, full[rows], rtol=0, atol=1e-5)


def test_model_output_is_float32_when_weights_are_bfloat16(random_ckpt: Path) -> None:
    model = load_model(random_ckpt, device="cpu", dtype="bfloat16", progress=False)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert our_logits(model, torch.tensor([1, 2, 3])).dtype == torch.float32


# ---------------------------------------------------------------- weights: merging, tying


def test_merged_qkv_and_gate_up_equal_the_unmerged_checkpoint_tensors(
    our_model: BaseLLMModel, random_ckpt: Path
) -> None:
    hf = load_file(random_ckpt / "model.safetensors")
    for i in range(4):
        attn, mlp = f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp"
        qkv = our_model.get_parameter(f"{attn}.qkv_proj.weight")
        gate_up = our_model.get_parameter(f"{mlp}.gate_up_proj.weight")
        assert torch.equal(qkv, torch.cat([hf[f"{attn}.{p}_proj.weight"] for p in "qkv"]))
        assert torch.equal(gate_up, torch.cat([hf[f"{mlp}.gate_proj.weight"],
                                               hf[f"{mlp}.up_proj.weight"]]))


def test_tied_checkpoint_has_no_lm_head_and_the_head_shares_the_embedding(
    our_model: BaseLLMModel, random_ckpt: Path
) -> None:
    with safe_open(random_ckpt / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    assert our_model.lm_head.weight is our_model.model.embed_tokens.weight
    assert "lm_head.weight" not in dict(our_model.named_parameters())


def test_untied_checkpoint_loads_its_own_lm_head(tmp_path: Path) -> None:
    ckpt = write_random_qwen3(tmp_path / "untied", tie=False, seed=1)
    ours = load_model(ckpt, device="cpu", progress=False)
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    ids = torch.randint(0, 2048, (12,))
    assert rel_err(our_logits(ours, ids), reference_logits(hf, ids)) <= REL_TOL


def test_a_tied_checkpoint_that_also_stores_lm_head_is_accepted(
    edit_checkpoint: Callable[..., Path], our_model: BaseLLMModel
) -> None:
    def add_copy(t: dict) -> None:
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    model = load_model(edit_checkpoint(add_copy), device="cpu", progress=False)
    ids = torch.randint(0, 2048, (5,))
    assert torch.equal(our_logits(model, ids), our_logits(our_model, ids))


# ---------------------------------------------------------------- errors that name the problem


def test_a_missing_tensor_is_an_error_naming_it(edit_checkpoint: Callable[..., Path]) -> None:
    ckpt = edit_checkpoint(lambda t: t.pop("model.layers.2.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointMismatchError,
                       match=r"missing.*model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_model(ckpt, device="cpu", progress=False)


def test_an_unexpected_tensor_is_an_error_naming_it(edit_checkpoint: Callable[..., Path]) -> None:
    def add(t: dict) -> None:
        t["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(CheckpointMismatchError,
                       match=r"unexpected.*model\.layers\.0\.mlp\.extra_proj\.weight"):
        load_model(edit_checkpoint(add), device="cpu", progress=False)


def test_a_tensor_of_the_wrong_shape_is_an_error_naming_it(
    edit_checkpoint: Callable[..., Path]
) -> None:
    def shrink(t: dict) -> None:
        name = "model.layers.1.mlp.down_proj.weight"
        t[name] = t[name][:, :500].contiguous()
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*\(256, 500\)"):
        load_model(edit_checkpoint(shrink), device="cpu", progress=False)


def test_an_unknown_architecture_is_an_error_listing_the_supported_ones(
    random_ckpt: Path, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel.*supported: .*Qwen3ForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])
    ckpt = shutil.copytree(random_ckpt, tmp_path / "gpt2")
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="MambaForCausalLM"):
        load_model(ckpt, device="cpu", progress=False)
    assert "Qwen3ForCausalLM" in supported_architectures()


# ---------------------------------------------------------------- sharded checkpoints


def test_a_two_shard_checkpoint_streams_one_file_at_a_time_and_loads_identically(
    random_ckpt: Path, our_model: BaseLLMModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = shutil.copytree(random_ckpt, tmp_path / "sharded")
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, out / file)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    (out / "consolidated.safetensors").write_bytes(b"not listed in the index: never opened")

    open_now, most_open, opened = 0, 0, []
    real_safe_open = weight_module.safe_open

    class CountingSafeOpen:
        def __init__(self, path, *args, **kwargs):
            self.inner = real_safe_open(path, *args, **kwargs)
            opened.append(Path(path).name)

        def __enter__(self):
            nonlocal open_now, most_open
            open_now += 1
            most_open = max(most_open, open_now)
            return self.inner.__enter__()

        def __exit__(self, *exc):
            nonlocal open_now
            open_now -= 1
            return self.inner.__exit__(*exc)

    monkeypatch.setattr(weight_module, "safe_open", CountingSafeOpen)
    assert [f.name for f in checkpoint_files(out)] == sorted(shards)
    model = load_model(out, device="cpu", progress=False)
    assert most_open == 1, "shards must be opened one after the other"
    assert set(opened) == set(shards), f"opened {opened}"
    expected = dict(our_model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, expected[name]), name


# ---------------------------------------------------------------- the attention seam


def test_the_model_calls_the_current_attention_backend_once_per_layer(
    our_model: BaseLLMModel
) -> None:
    calls: list[tuple[int, tuple, tuple]] = []
    dense = DenseCausalAttention()

    class Recording:
        def forward(self, q, k, v, layer_id):
            calls.append((layer_id, tuple(q.shape), tuple(k.shape)))
            return dense.forward(q, k, v, layer_id)

    ids = torch.randint(0, 2048, (6,))
    with use_attention_backend(Recording()):
        logits = our_logits(our_model, ids)
    assert isinstance(get_attention_backend(), DenseCausalAttention), "the default comes back"
    assert calls == [(layer, (6, 4, 64), (6, 2, 64)) for layer in range(4)]
    assert torch.equal(logits, our_logits(our_model, ids))


def test_dense_causal_attention_equals_sdpa_with_repeated_kv_heads() -> None:
    q, k, v = torch.randn(11, 4, 64), torch.randn(11, 2, 64), torch.randn(11, 2, 64)
    out = DenseCausalAttention().forward(q, k, v, layer_id=0)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    assert (out - ref).abs().max().item() <= 1e-5


# ---------------------------------------------------------------- GPU, bfloat16

# In bfloat16 the two implementations round in different places (ours keeps RoPE and the
# attention softmax in float32), so they are compared with the float32 reference instead of
# with each other: ours must be about as close to it as transformers' own bfloat16 run is.
BF16_REL_TOL = 3e-2  # tiny-qwen3: 4 layers
BF16_VS_HF_FACTOR = 1.5  # and never much worse than transformers in bfloat16


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["tiny-qwen3", "qwen3-0.6b-like"])
def test_bfloat16_logits_match_transformers_on_cuda(which: str, tiny_model_dir: Path) -> None:
    """bf16 on CUDA, measured against transformers in float32 on the same GPU.

    err(x) = max |x - float32 reference| / max |float32 reference|. Ours must satisfy
    err(ours) <= max(3e-2, 1.5 * err(transformers in bf16)); float32 on CUDA must be <= 1e-3.
    """
    ckpt = tiny_model_dir if which == "tiny-qwen3" else tiny_model_dir.parent / which
    if not (ckpt / "config.json").is_file():
        pytest.skip(f"{ckpt} is absent; write it with "
                    "python tools/make_tiny_model.py --like qwen3-0.6b")
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    hf32 = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to("cuda").eval()
    hf16 = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to("cuda").eval()
    ours32 = load_model(ckpt, device="cuda", dtype="float32", progress=False)
    ours16 = load_model(ckpt, device="cuda", dtype="bfloat16", progress=False)
    report = []
    for prompt in PROMPTS:
        ids = torch.tensor(tokenizer.encode(prompt), device="cuda")
        positions = torch.arange(len(ids), device="cuda")
        with torch.inference_mode():
            ref = hf32(ids[None]).logits[0]
            errs = {"ours-fp32": rel_err(ours32(ids, positions), ref),
                    "ours-bf16": rel_err(ours16(ids, positions), ref),
                    "hf-bf16": rel_err(hf16(ids[None]).logits[0], ref)}
        report.append(errs)
        assert errs["ours-fp32"] <= 1e-3, f"{which} {prompt!r}: float32 on CUDA {errs}"
        limit = max(BF16_REL_TOL, BF16_VS_HF_FACTOR * errs["hf-bf16"])
        assert errs["ours-bf16"] <= limit, f"{which} {prompt!r}: {errs}, limit {limit:.2e}"
    print(f"\n{which}: relative errors against transformers float32:")
    for errs in report:
        print("  " + ", ".join(f"{k} {v:.2e}" for k, v in errs.items()))
