"""Chapter 18: Llama, Qwen2 and Qwen3-MoE give transformers' logits and greedy tokens.

Each family is checked on its tiny checkpoint (``tools/make_tiny_model.py --arch ...``) in
float32 on the CPU: logits within chapter 3's tolerance, greedy tokens identical to
``transformers.generate`` with and without the KV cache, through ``LLM`` and through the server
with the ``openai`` client. Checkpoints that transformers itself writes cover the settings the
tiny ones do not (a tied Llama with biases, Qwen3-MoE with ``decoder_sparse_step`` 2 and no
renormalisation). The MoE computations are compared with each other and with a dense MLP, on
routings built to hit the edge cases.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from minisgl.core import SamplingParams
from minisgl.distributed import set_tp_info
from minisgl.layers import silu_and_mul
from minisgl.models import load_model
from minisgl.models.base import BaseLLMModel
from minisgl.models.register import get_model_class, supported_architectures
from minisgl.models.weight import CheckpointMismatchError
from minisgl.moe import MoEExperts, Routing, route_topk, use_moe_impl
from minisgl.moe.grouped import moe_grouped, sort_by_expert
from minisgl.moe.reference import moe_reference

ROOT = Path(__file__).resolve().parent.parent
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
         "qwen3-moe": "Qwen3MoeForCausalLM"}
REL_TOL = 1e-4  # chapter 3's: max |ours - transformers| / max |transformers| over all logits
NEW_TOKENS = 24
PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "1, 2, 3, 4,",
    "Hello! How are you today?",
    "东京是日本的首都",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog.",
    "a",
]


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    assert ours.shape == ref.shape
    return ((ours.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def tiny_checkpoint(arch: str) -> Path:
    """models/tiny-<arch>, written by make_tiny_model.py the first time it is asked for."""
    out = ROOT / "models" / f"tiny-{arch}"
    if not (out / "model.safetensors").exists():
        subprocess.run([sys.executable, str(ROOT / "tools" / "make_tiny_model.py"), "--arch",
                        arch, "--out", str(out)], check=True, cwd=ROOT, capture_output=True)
    return out


@pytest.fixture(scope="module", params=list(ARCHS))
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def ckpt(arch: str) -> Path:
    return tiny_checkpoint(arch)


@pytest.fixture(scope="module")
def hf_model(ckpt: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def our_model(ckpt: Path) -> BaseLLMModel:
    return load_model(ckpt, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def prompt_ids(ckpt: Path) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference_greedy(hf_model: torch.nn.Module, prompt_ids: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations, EOS disabled so every one runs NEW_TOKENS tokens."""
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            x = torch.tensor([ids])
            out = hf_model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            outputs.append(out[0, len(ids):].tolist())
    assert len({tuple(o) for o in outputs}) == len(PROMPTS), "prompts should continue differently"
    return outputs


# ------------------------------------------------------------------ the registry


def test_the_registry_names_every_family() -> None:
    assert set(supported_architectures()) >= {"Qwen3ForCausalLM", *ARCHS.values()}
    for name in ARCHS.values():
        assert get_model_class([name]).__name__ == name
    with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM"):
        get_model_class(["GPT2LMHeadModel"])


def test_tiny_checkpoints_are_the_families_they_claim(arch: str, our_model: BaseLLMModel,
                                                       hf_model: torch.nn.Module) -> None:
    assert type(our_model).__name__ == type(hf_model).__name__ == ARCHS[arch]
    names = dict(our_model.named_parameters())
    has_bias = any(n.endswith("qkv_proj.bias") for n in names)
    has_qk_norm = any(n.endswith("q_norm.weight") for n in names)
    assert (has_bias, has_qk_norm) == {"llama": (False, False), "qwen2": (True, False),
                                       "qwen3-moe": (False, True)}[arch]


# ------------------------------------------------------------------ against transformers


def test_logits_match_transformers(arch: str, our_model: BaseLLMModel, hf_model: torch.nn.Module,
                                   prompt_ids: list[list[int]]) -> None:
    with torch.inference_mode():
        for prompt, ids in zip(PROMPTS, prompt_ids):
            x = torch.tensor(ids)
            ref = hf_model(x[None], position_ids=torch.arange(len(ids))[None]).logits[0]
            err = rel_err(our_model(x, torch.arange(len(ids))), ref)
            assert err <= REL_TOL, f"{arch}, prompt {prompt!r}: relative error {err:.2e}"


@pytest.mark.parametrize("use_cache", [True, False], ids=["kv_cache", "no_cache"])
def test_greedy_matches_transformers(arch: str, our_model: BaseLLMModel,
                                     prompt_ids: list[list[int]],
                                     reference_greedy: list[list[int]], use_cache: bool) -> None:
    from minisgl.engine.simple_loop import generate

    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for prompt, ids, want in zip(PROMPTS, prompt_ids, reference_greedy, strict=True):
        got = generate(our_model, ids, params, use_cache=use_cache).token_ids
        assert got == want, f"{arch}, prompt {prompt!r}: tokens differ from transformers"


@pytest.fixture(scope="module")
def llm(ckpt: Path):
    from minisgl.llm import LLM

    return LLM(ckpt, device="cpu")


def greedy_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)


def test_llm_greedy_matches_transformers(arch: str, llm, prompt_ids: list[list[int]],
                                         reference_greedy: list[list[int]]) -> None:
    results = llm.generate(prompt_ids, greedy_params())  # one batch: paged cache, many requests
    for prompt, result, want in zip(PROMPTS, results, reference_greedy, strict=True):
        assert result["token_ids"] == want, f"{arch}, prompt {prompt!r} through LLM"


def test_server_greedy_matches_transformers(arch: str, ckpt: Path, llm,
                                            prompt_ids: list[list[int]],
                                            reference_greedy: list[list[int]],
                                            tmp_path: Path) -> None:
    from openai import OpenAI
    from server_process import ServerProcess  # tools/, see conftest.py

    expected = llm.generate(prompt_ids, greedy_params())
    with ServerProcess(ckpt, device="cpu", log_path=tmp_path / "server.log",
                       args=("--served-model-name", arch)) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)
        for prompt, ids, want, result in zip(PROMPTS, prompt_ids, reference_greedy, expected):
            reply = client.completions.create(model=arch, prompt=ids, max_tokens=NEW_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
            assert reply.usage.completion_tokens == len(want)
            assert result["token_ids"] == want
            assert reply.choices[0].text == result["text"], f"{arch}, prompt {prompt!r}"


def test_tp2_greedy_equals_tp1(arch: str, ckpt: Path, llm, prompt_ids: list[list[int]]) -> None:
    """Chapter 17's tensor parallelism on each family: two gloo ranks, each with half the
    heads (and, for Qwen3-MoE, half of every expert's intermediate width), give TP=1's tokens."""
    from minisgl.llm import LLM

    expected = [r["token_ids"] for r in llm.generate(prompt_ids, greedy_params())]
    with LLM(ckpt, device="cpu", tp=2) as sharded:
        got = [r["token_ids"] for r in sharded.generate(prompt_ids, greedy_params())]
    assert got == expected, f"{arch}: greedy tokens at TP=2 differ from TP=1"


# ------------------------------------------------------------------ checkpoints transformers writes


def randomize_and_save(model: torch.nn.Module, out: Path, seed: int = 0) -> Path:
    """Spread-out random weights (the default init is too gentle to catch mistakes), saved."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, p.shape[-1] ** -0.5)
    model.save_pretrained(out)
    return out


def assert_same_logits(ckpt: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    ours = load_model(ckpt, device="cpu", dtype="float32", progress=False)
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids[None], position_ids=torch.arange(40)[None]).logits[0]
        err = rel_err(ours(ids, torch.arange(40)), ref)
    assert err <= REL_TOL, f"relative error {err:.2e}"


def test_tied_llama_with_biases_and_llama3_rope_matches(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=512, max_position_embeddings=2048, rms_norm_eps=1e-5,
        attention_bias=True, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 256})
    assert_same_logits(randomize_and_save(LlamaForCausalLM(config), tmp_path))


def test_qwen3_with_attention_bias_has_a_bias_on_all_four_projections(tmp_path: Path) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
        attention_bias=True, tie_word_embeddings=False)
    assert_same_logits(randomize_and_save(Qwen3ForCausalLM(config), tmp_path))


@pytest.mark.parametrize("step, only_mlp, renorm", [(2, [], False), (1, [0, 3], True)])
def test_qwen3_moe_sparse_layer_choice_and_renormalisation(tmp_path: Path, step: int,
                                                           only_mlp: list[int],
                                                           renorm: bool) -> None:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from minisgl.moe import SparseMoeBlock

    config = Qwen3MoeConfig(
        hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=6,
        num_experts_per_tok=3, decoder_sparse_step=step, mlp_only_layers=only_mlp,
        norm_topk_prob=renorm, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=2048,
        tie_word_embeddings=False)
    ckpt = randomize_and_save(Qwen3MoeForCausalLM(config), tmp_path)
    assert_same_logits(ckpt)
    ours = load_model(ckpt, device="cpu", progress=False)
    sparse = [i for i, layer in enumerate(ours.model.layers)
              if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse == [i for i in range(4) if i not in only_mlp and (i + 1) % step == 0]


@pytest.mark.parametrize("raw, message", [
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be an integer >= 1, got 0"),
    ({"decoder_sparse_step": True}, "decoder_sparse_step must be an integer >= 1, got True"),
    ({"mlp_only_layers": [1, True]}, "mlp_only_layers must be a list of layer indices"),
])
def test_qwen3_moe_layer_choice_settings_are_checked(raw: dict[str, object],
                                                     message: str) -> None:
    import json

    from minisgl.models.config import ConfigError, ModelConfig
    from minisgl.models.qwen3_moe import sparse_layer_ids

    base = json.loads((tiny_checkpoint("qwen3-moe") / "config.json").read_text())
    with pytest.raises(ConfigError, match=re.escape(message)):
        sparse_layer_ids(ModelConfig.from_dict({**base, **raw}))


def test_a_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_checkpoint("qwen3-moe")
    out = tmp_path / "broken"
    out.mkdir()
    for f in src.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(out / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, out / "model.safetensors")
    with pytest.raises(CheckpointMismatchError, match=r"model\.layers\.1\.mlp\.experts\.5\."
                                                      r"up_proj\.weight"):
        load_model(out, device="cpu", progress=False)


# ------------------------------------------------------------------ the MoE computations

E, H, INTER = 8, 64, 32


def random_experts(seed: int = 0, dtype: torch.dtype = torch.float32,
                   device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * H**-0.5
    down = torch.randn(E, H, INTER, generator=g) * INTER**-0.5
    return gate_up.to(device, dtype), down.to(device, dtype)


def dense_expert(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_and_mul(F.linear(x, gate_up)), down)


@pytest.mark.parametrize("num_tokens, top_k", [(1, 2), (7, 2), (64, 3), (33, 8)])
def test_grouped_equals_the_per_expert_loop(num_tokens: int, top_k: int) -> None:
    gate_up, down = random_experts()
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, H, generator=g)
    routing = route_topk(torch.randn(num_tokens, E, generator=g), top_k, renormalize=True)
    ref = moe_reference(x, gate_up, down, routing)
    assert rel_err(moe_grouped(x, gate_up, down, routing), ref) <= 1e-6
    # and both are the weighted sum of dense experts, written out token by token
    token = num_tokens - 1
    by_hand = sum(routing.weights[token, k] * dense_expert(
        x[token], gate_up[routing.expert_ids[token, k]], down[routing.expert_ids[token, k]])
        for k in range(top_k))
    torch.testing.assert_close(ref[token], by_hand, rtol=1e-5, atol=1e-6)


def test_router_keeps_the_top_k_renormalised_or_not() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    probs = logits.softmax(-1)[0]
    raw = route_topk(logits, 2, renormalize=False)
    assert raw.expert_ids.tolist() == [[1, 2]]
    torch.testing.assert_close(raw.weights[0], probs[[1, 2]])
    renorm = route_topk(logits, 2, renormalize=True)
    torch.testing.assert_close(renorm.weights[0], probs[[1, 2]] / probs[[1, 2]].sum())


def test_ties_go_to_the_lower_expert_index() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, 3.0],   # four tied at the top
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # all tied
    routing = route_topk(logits, 2, renormalize=True)
    assert routing.expert_ids.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(routing.weights, torch.full((2, 2), 0.5))


def test_an_expert_no_token_chose_is_never_read() -> None:
    gate_up, down = random_experts()
    gate_up[3] = float("nan")  # any read of expert 3 would poison the output
    down[3] = float("nan")
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(2))
    ids = torch.tensor([[0, 1], [1, 2], [2, 4], [4, 5], [5, 6], [6, 7], [7, 0], [0, 2],
                        [1, 4], [4, 6]])  # every expert but 3
    routing = Routing(expert_ids=ids, weights=torch.full(ids.shape, 0.5))
    ref = moe_reference(x, gate_up, down, routing)
    assert torch.isfinite(ref).all()
    assert rel_err(moe_grouped(x, gate_up, down, routing), ref) <= 1e-6


def test_every_token_on_one_expert_is_that_expert_dense() -> None:
    gate_up, down = random_experts()
    x = torch.randn(12, H, generator=torch.Generator().manual_seed(3))
    logits = torch.full((12, E), -10.0)
    logits[:, 5] = 10.0
    routing = route_topk(logits, 1, renormalize=True)  # weight exactly 1 on expert 5
    dense = dense_expert(x, gate_up[5], down[5])
    for compute in (moe_reference, moe_grouped):
        torch.testing.assert_close(compute(x, gate_up, down, routing), dense)


def test_sort_by_expert_groups_pairs_and_counts_empty_experts() -> None:
    ids = torch.tensor([[2, 0], [2, 5], [0, 2]])
    groups = sort_by_expert(ids, num_experts=6)
    flat = ids.flatten()
    assert flat[groups.pair_ids].tolist() == [0, 0, 2, 2, 2, 5]
    assert groups.token_ids.tolist() == [0, 2, 0, 1, 2, 1]
    assert groups.ends.tolist() == [2, 2, 5, 5, 5, 6]


def test_experts_split_over_two_ranks_sum_to_the_whole() -> None:
    """Tensor parallelism: each rank keeps half of every expert's intermediate dimension; the
    two partial outputs (what the all-reduce adds) equal the unsplit layer's output."""
    gate_up, down = random_experts()
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    routing = route_topk(torch.randn(9, E, generator=torch.Generator().manual_seed(6)), 2, True)

    def build(rank: int, size: int) -> MoEExperts:
        previous = set_tp_info(rank, size)
        try:
            layer = MoEExperts(E, H, INTER)
        finally:
            set_tp_info(previous.rank, previous.size)
        for e in range(E):
            layer.load_weight(gate_up[e, :INTER], (e, 0), "gate_up_proj")
            layer.load_weight(gate_up[e, INTER:], (e, 1), "gate_up_proj")
            layer.load_weight(down[e], e, "down_proj")
        return layer

    whole = build(0, 1)
    torch.testing.assert_close(whole.gate_up_proj, gate_up)
    halves = [build(r, 2) for r in range(2)]
    assert halves[0].gate_up_proj.shape == (E, INTER, H)
    with use_moe_impl("reference"):
        full = whole(x, routing)
        partial = [moe_reference(x, h.gate_up_proj, h.down_proj, routing) for h in halves]
    torch.testing.assert_close(partial[0] + partial[1], full, rtol=1e-5, atol=1e-6)


def test_expert_tensors_with_a_wrong_slot_are_refused() -> None:
    layer = MoEExperts(E, H, INTER)
    tensor = torch.zeros(INTER, H)
    with pytest.raises(ValueError, match=r"expert index in 0\.\.7"):
        layer.load_weight(tensor, (E, 0), "gate_up_proj")
    with pytest.raises(ValueError, match=r"gate_up_proj with shard_id \(expert, 0\|1\)"):
        layer.load_weight(tensor, (0, 2), "gate_up_proj")
    with pytest.raises(ValueError, match="expected a checkpoint tensor with 32 entries"):
        layer.load_weight(torch.zeros(INTER + 1, H), (0, 1), "gate_up_proj")


def test_the_whole_moe_model_is_the_same_through_every_cpu_path() -> None:
    model = load_model(tiny_checkpoint("qwen3-moe"), device="cpu", progress=False)
    ids = torch.arange(3, 60)
    with torch.inference_mode():
        with use_moe_impl("reference"):
            ref = model(ids, torch.arange(len(ids)))
        with use_moe_impl("grouped"):
            grouped = model(ids, torch.arange(len(ids)))
    assert rel_err(grouped, ref) <= 1e-6
    with pytest.raises(ValueError, match="unknown MoE implementation 'cutlass'"):
        with use_moe_impl("cutlass"):
            pass


