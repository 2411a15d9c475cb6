"""Tests for tools/make_tiny_model.py: the checkpoint every other test runs on.

The tool is run the way a reader runs it, as a subprocess, into temporary directories; the
`tiny_model_dir` fixture (tests/conftest.py) gives the shared copy under models/tiny-qwen3.
"""
from __future__ import annotations

import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "make_tiny_model.py"
FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json"]

# Where Qwen3 (and therefore our 0.6b-like tokenizer) puts its marker tokens.
QWEN3_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
             "<think>": 151667, "</think>": 151668}
# The tiny tokenizer: 2,022 ordinary tokens, then Qwen3's 26 added tokens in Qwen3's order.
TINY_IDS = {"<|endoftext|>": 2022, "<|im_start|>": 2023, "<|im_end|>": 2024,
            "<think>": 2046, "</think>": 2047}


def run_tool(*args: str) -> subprocess.CompletedProcess[str]:
    """Run make_tiny_model.py with `args`; never raises on a non-zero exit."""
    return subprocess.run([sys.executable, str(TOOL), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def tool(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("tools/make_tiny_model.py")


@pytest.fixture(scope="module")
def fresh_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A tiny checkpoint written by a separate run of the tool, and what that run printed."""
    out = tmp_path_factory.mktemp("fresh") / "tiny-qwen3"
    result = run_tool("--out", str(out))
    assert result.returncode == 0, result.stderr
    return out, result.stdout


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def like_06b_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The 0.6b-like checkpoint without its 1.2 GB of weights."""
    out = tmp_path_factory.mktemp("like") / "qwen3-0.6b-like"
    result = run_tool("--like", "qwen3-0.6b", "--no-weights", "--out", str(out))
    assert result.returncode == 0, result.stderr
    return out


# ---------------------------------------------------------------------------------------------
# Determinism and the command line
# ---------------------------------------------------------------------------------------------


def test_two_runs_write_identical_bytes(fresh_build: tuple[Path, str], tmp_path: Path) -> None:
    first, _ = fresh_build
    result = run_tool("--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in first.iterdir()) == FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == FILES
    for name in FILES:
        assert (first / name).read_bytes() == (tmp_path / name).read_bytes(), f"{name} differs"


def test_models_dir_copy_matches_a_fresh_build(tiny_model_dir: Path,
                                               fresh_build: tuple[Path, str]) -> None:
    fresh, _ = fresh_build
    stale = [name for name in FILES
             if (tiny_model_dir / name).read_bytes() != (fresh / name).read_bytes()]
    assert not stale, (f"{tiny_model_dir} is out of date ({', '.join(stale)}); "
                       "rebuild it with: python tools/make_tiny_model.py")


def test_seed_changes_only_the_weights(tool: ModuleType, fresh_build: tuple[Path, str],
                                       tmp_path: Path) -> None:
    seed0, _ = fresh_build
    tool.write_checkpoint(tmp_path, tool.TINY_QWEN3, seed=1)
    for name in FILES:
        same = (seed0 / name).read_bytes() == (tmp_path / name).read_bytes()
        assert same == (name != "model.safetensors"), name


def test_prints_a_summary(fresh_build: tuple[Path, str]) -> None:
    out, stdout = fresh_build
    assert str(out) in stdout
    assert "2,886,400 parameters" in stdout
    assert "model.safetensors 11.0 MiB" in stdout
    assert "vocab 2048: <|endoftext|> 2022, <|im_start|> 2023, <|im_end|> 2024" in stdout


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3-moe"])
def test_other_families_are_deterministic_too(arch: str, tmp_path: Path) -> None:
    first, second = (run_tool("--arch", arch, "--out", str(tmp_path / name)) for name in "ab")
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


@pytest.mark.parametrize("like", ["llama-3.2-1b", "qwen3-moe"])
def test_like_shapes_are_what_transformers_builds_from_their_config(like: str,
                                                                      tmp_path: Path) -> None:
    """transformers reads the config and builds (on the meta device: no memory) a model with
    exactly the parameter count the tool writes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    result = run_tool("--like", like, "--no-weights", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    config = AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    count = sum(p.numel() for p in model.parameters())  # a tied head is counted once
    assert f"{count:,} parameters" in result.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--arch", "gpt2"], "unknown architecture 'gpt2'"),
    (["--like", "qwen3-7b"], "unknown --like 'qwen3-7b'; choose from qwen3-0.6b"),
    (["--like", "llama-3.2-1b", "--arch", "qwen2"],
     "--like llama-3.2-1b is a LlamaForCausalLM, not --arch qwen2"),
    (["--seed", "-1"], "--seed must be >= 0, got -1"),
    (["--seed", "one"], "invalid int value: 'one'"),
])
def test_bad_arguments_are_rejected(tool: ModuleType, capsys: pytest.CaptureFixture[str],
                                    args: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        tool.main(args)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_out_must_not_be_a_file(tool: ModuleType, capsys: pytest.CaptureFixture[str],
                                tmp_path: Path) -> None:
    target = tmp_path / "file.txt"
    target.write_text("not a directory")
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--out", str(target)])
    assert exit_info.value.code == 2
    assert f"--out {target} exists and is not a directory" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# The tiny checkpoint
# ---------------------------------------------------------------------------------------------


def test_config_is_tiny_qwen3(tiny_model_dir: Path) -> None:
    config = json.loads((tiny_model_dir / "config.json").read_text())
    expected = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048,
        "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "tie_word_embeddings": True, "rope_theta": 1e6, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32",
        "bos_token_id": TINY_IDS["<|endoftext|>"], "eos_token_id": TINY_IDS["<|im_end|>"],
    }
    assert {key: config[key] for key in expected} == expected


def test_weights_are_qwen3_tensors_with_tied_head(tiny_model_dir: Path) -> None:
    from safetensors import safe_open

    with safe_open(tiny_model_dir / "model.safetensors", framework="pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        embed = f.get_tensor("model.embed_tokens.weight")
        q_norm = f.get_tensor("model.layers.0.self_attn.q_norm.weight")
        q_proj = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k_proj = f.get_tensor("model.layers.3.self_attn.k_proj.weight")
    assert len(names) == 2 + 4 * 11
    assert "lm_head.weight" not in names  # tied to the embedding
    assert embed.shape == (2048, 256) and embed.dtype == torch.float32
    assert q_proj.shape == (256, 256) and k_proj.shape == (128, 256)
    assert q_norm.shape == (64,)
    assert not torch.equal(q_norm, torch.ones(64)), "norm weights should not be plain ones"
    assert abs(q_proj.mean().item()) < 0.01 and 0.1 < q_proj.std().item() < 0.15


def test_portable_normal_is_chunk_invariant_and_centred(tool: ModuleType) -> None:
    whole = tool.portable_normal(10_000, 0.5, torch.Generator().manual_seed(3))
    gen = torch.Generator().manual_seed(3)
    parts = torch.cat([tool.portable_normal(n, 0.5, gen) for n in (1, 999, 5000, 4000)])
    assert torch.equal(whole, parts)
    assert abs(whole.mean().item()) < 0.02
    assert abs(whole.std().item() - 0.5) < 0.02


def test_transformers_loads_and_greedy_text_keeps_changing(tiny_model_dir: Path,
                                                          hf_tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.dtype == torch.float32
    for prompt in ["Hello, my name is", "def main():", "The capital of France is"]:
        ids = hf_tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        new = out[0, ids.shape[1]:].tolist()
        longest_repeat = max(len(list(run)) for _, run in itertools.groupby(new))
        assert len(set(new)) >= 8 and longest_repeat < 16, (
            f"greedy output for {prompt!r} is degenerate: {new}")


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_special_tokens(tiny_model_dir: Path, hf_tokenizer) -> None:
    assert len(hf_tokenizer) == 2048
    assert {tok: hf_tokenizer.convert_tokens_to_ids(tok) for tok in TINY_IDS} == TINY_IDS
    assert hf_tokenizer.eos_token == "<|im_end|>"
    assert hf_tokenizer.pad_token == "<|endoftext|>"
    assert hf_tokenizer.bos_token is None
    # Like Qwen3: <|im_end|> is special (dropped when skipping specials), <think> is not.
    ids = hf_tokenizer("<think>x</think>ok<|im_end|>", add_special_tokens=False).input_ids
    assert ids[0] == TINY_IDS["<think>"] and ids[-1] == TINY_IDS["<|im_end|>"]
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == "<think>x</think>ok"
    generation = json.loads((tiny_model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [TINY_IDS["<|im_end|>"], TINY_IDS["<|endoftext|>"]]
    assert "do_sample" not in generation  # transformers' generate() defaults to greedy


ROUND_TRIP_EXAMPLES = [
    "Hello, world! The engine batches 8 requests.",
    "  leading spaces, trailing spaces  \n\ttabs\r\nwindows newline\n\n\n",
    "敏捷的棕色狐狸跳过了懒狗。",
    "こんにちは、世界！한국어 텍스트",
    "😀 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "mixed: naïve café, 数学 ∑x² = 42 🚀, e\u0301 (combining accent, not NFC)",
    "\x00 control \x07 bytes \x7f and U+FFFD \ufffd",
    "<|im_start|>user\nliteral markers<|im_end|>\n<think>\n</think>",
    "",
]


@pytest.mark.parametrize("text", ROUND_TRIP_EXAMPLES)
def test_round_trip_examples(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text


@settings(max_examples=300, deadline=None)
@given(text=st.text(max_size=64))
def test_round_trip_any_unicode(hf_tokenizer, text: str) -> None:
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("char", ["中", "語", "한", "😀", "🚀", "€"])
def test_cjk_and_emoji_split_into_several_tokens(hf_tokenizer, char: str) -> None:
    ids = hf_tokenizer(char, add_special_tokens=False).input_ids
    assert len(ids) >= 2, f"{char!r} should need several byte tokens, got {ids}"
    # No single piece is the character: a streaming detokenizer must wait for all of them.
    assert all(hf_tokenizer.decode([i]) != char for i in ids)
    assert hf_tokenizer.decode(ids) == char


def test_tokenizer_asset_is_small_and_committed_form() -> None:
    asset = ROOT / "tools" / "assets" / "tokenizer.json"
    assert asset.stat().st_size < 300_000
    data = json.loads(asset.read_text(encoding="utf-8"))
    assert len(data["model"]["vocab"]) == 2022
    assert data["normalizer"] is None  # no NFC: every string round-trips exactly
    assert [tok["id"] for tok in data["added_tokens"]] == list(range(2022, 2048))


# ---------------------------------------------------------------------------------------------
# The chat template: expected strings are Qwen3's ChatML format, written out by hand:
#   each turn                 <|im_start|>{role}\n{content}<|im_end|>\n
#   add_generation_prompt     <|im_start|>assistant\n
#   enable_thinking=False     ... followed by <think>\n\n</think>\n\n
#   assistant turns before the last user message lose their <think> reasoning; those after it
#   render as <think>\n{reasoning}\n</think>\n\n{answer} (an empty block for the final turn).
# ---------------------------------------------------------------------------------------------

SYSTEM_AND_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
]
SYSTEM_AND_USER_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def render(tokenizer, messages: list[dict], **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


def test_chat_generation_prompt(hf_tokenizer) -> None:
    assert render(hf_tokenizer, SYSTEM_AND_USER, add_generation_prompt=True) \
        == SYSTEM_AND_USER_PROMPT
    assert render(hf_tokenizer, SYSTEM_AND_USER, add_generation_prompt=True,
                  enable_thinking=True) == SYSTEM_AND_USER_PROMPT


def test_chat_enable_thinking_false_prefills_an_empty_think_block(hf_tokenizer) -> None:
    assert render(hf_tokenizer, SYSTEM_AND_USER, add_generation_prompt=True,
                  enable_thinking=False) == SYSTEM_AND_USER_PROMPT + "<think>\n\n</think>\n\n"


def test_chat_without_generation_prompt(hf_tokenizer) -> None:
    assert render(hf_tokenizer, SYSTEM_AND_USER) == SYSTEM_AND_USER_PROMPT.removesuffix(
        "<|im_start|>assistant\n")


def test_chat_history_drops_old_reasoning_and_keeps_recent(hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello!"},
        {"role": "user", "content": "Tell me a joke."},
        {"role": "assistant", "content": "<think>\nKeep it short.\n</think>\n\nNo."},
    ]
    assert render(hf_tokenizer, messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n"
        "<|im_start|>user\nTell me a joke.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nKeep it short.\n</think>\n\nNo.<|im_end|>\n"
    )


def test_chat_final_answer_gets_an_empty_think_block(hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert render(hf_tokenizer, messages) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"
    )


def test_chat_reasoning_content_field(hf_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "reasoning_content": "Greet back."},
        {"role": "user", "content": "Bye"},
    ]
    assert render(hf_tokenizer, messages[:2]) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nGreet back.\n</think>\n\nHello<|im_end|>\n"
    )
    assert render(hf_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_tool_calls_and_results(hf_tokenizer) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "22C"},
    ]
    assert render(hf_tokenizer, messages, add_generation_prompt=True) == (
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\n22C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chat_markers_are_single_tokens(hf_tokenizer) -> None:
    ids = hf_tokenizer.apply_chat_template(SYSTEM_AND_USER, add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    assert ids[0] == TINY_IDS["<|im_start|>"]
    assert ids.count(TINY_IDS["<|im_start|>"]) == 3
    assert ids.count(TINY_IDS["<|im_end|>"]) == 2


def test_chat_unknown_role_is_an_error(hf_tokenizer) -> None:
    with pytest.raises(Exception, match="unknown message role: narrator"):
        render(hf_tokenizer, [{"role": "narrator", "content": "Once upon a time"}])


def test_chat_tool_definitions_are_rendered_as_qwen3_does(hf_tokenizer) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = render(hf_tokenizer, SYSTEM_AND_USER, tools=tools)
    system = SYSTEM_AND_USER[0]["content"]
    assert text.startswith(f"<|im_start|>system\n{system}\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    assert text.count("<|im_start|>system") == 1  # the system text went into the tools turn
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}' in text


# ---------------------------------------------------------------------------------------------
# --like qwen3-0.6b (checked without writing its 1.2 GB of weights)
# ---------------------------------------------------------------------------------------------


def test_like_06b_config_is_qwen3_06b(like_06b_dir: Path) -> None:
    config = json.loads((like_06b_dir / "config.json").read_text())
    expected = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
        "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
        "tie_word_embeddings": True, "rope_theta": 1e6, "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6, "torch_dtype": "bfloat16",
        "bos_token_id": 151643, "eos_token_id": 151645,
    }
    assert {key: config[key] for key in expected} == expected
    assert not (like_06b_dir / "model.safetensors").exists()


def test_like_06b_tokenizer_covers_every_id(like_06b_dir: Path) -> None:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(like_06b_dir / "tokenizer.json"))
    vocab_size = 151936
    assert tokenizer.get_vocab_size(with_added_tokens=True) == vocab_size
    missing = [i for i in range(vocab_size) if tokenizer.id_to_token(i) is None]
    assert not missing, f"ids without a token: {missing[:10]}"
    texts = tokenizer.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    assert len(texts) == vocab_size
    assert {tok: tokenizer.token_to_id(tok) for tok in QWEN3_IDS} == QWEN3_IDS
    # The ordinary tokens of the tiny tokenizer keep their ids.
    tiny = Tokenizer.from_file(str(ROOT / "tools" / "assets" / "tokenizer.json"))
    assert all(tokenizer.id_to_token(i) == tiny.id_to_token(i) for i in range(2022))
    text = "<|im_start|>user\n你好 😀 naïve<|im_end|>"
    ids = tokenizer.encode(text).ids
    assert ids[0] == QWEN3_IDS["<|im_start|>"] and ids[-1] == QWEN3_IDS["<|im_end|>"]
    assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_like_06b_loads_in_transformers(like_06b_dir: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(like_06b_dir)
    assert config.model_type == "qwen3" and config.num_hidden_layers == 28
    tokenizer = AutoTokenizer.from_pretrained(like_06b_dir)
    assert len(tokenizer) == 151936
    assert tokenizer.eos_token_id == 151645
    prompt = render(tokenizer, SYSTEM_AND_USER, add_generation_prompt=True,
                    enable_thinking=False)
    assert prompt == SYSTEM_AND_USER_PROMPT + "<think>\n\n</think>\n\n"


@pytest.mark.slow
def test_like_06b_weights(tmp_path: Path) -> None:
    from safetensors import safe_open

    result = run_tool("--like", "qwen3-0.6b", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "596,049,920 parameters" in result.stdout
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert len(f.keys()) == 2 + 28 * 11
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_shape() == [151936, 1024] and embed.get_dtype() == "BF16"
        down = f.get_tensor("model.layers.27.mlp.down_proj.weight")
    assert down.shape == (1024, 3072) and down.dtype == torch.bfloat16
    assert (tmp_path / "model.safetensors").stat().st_size == pytest.approx(2 * 596_049_920,
                                                                            rel=1e-4)
