"""Chapter 1: config.json parsing, the KV arithmetic, environment variables, model resolution.

Nothing here loads weights or touches the network: the hub is replaced by a fake
``snapshot_download`` that records its calls.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minisgl.env import ENV_VARS, Env, EnvError, read_env
from minisgl.models.config import ConfigError, ModelConfig
from minisgl.utils import hf
from minisgl.utils.hf import ModelPathError, load_hf_config, looks_like_hub_id, resolve_model_path
from minisgl.utils.logger import configure_logging, get_logger

# The keys of Qwen3-0.6B's published config.json that the engine reads.
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None,
    "max_position_embeddings": 40960, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "bos_token_id": 151643, "eos_token_id": 151645,
}
# The smallest dict that parses: plain multi-head attention, no head_dim, no GQA key.
MINIMAL = {
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 512,
}
REQUIRED = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "rms_norm_eps", "rope_theta", "max_position_embeddings")


def with_(base: dict, **changes) -> dict:
    return {**base, **changes}


def without(base: dict, key: str) -> dict:
    return {k: v for k, v in base.items() if k != key}


# ---------------------------------------------------------------- config.json -> ModelConfig


def test_tiny_model_config_has_the_documented_shape(tiny_model_dir: Path) -> None:
    config = ModelConfig.from_pretrained(tiny_model_dir)
    assert config.architectures == ("Qwen3ForCausalLM",)
    assert (config.hidden_size, config.num_layers) == (256, 4)
    assert (config.num_qo_heads, config.num_kv_heads, config.head_dim) == (4, 2, 64)
    assert config.intermediate_size == 512 and config.tie_word_embeddings
    assert config.rope_theta == 1e6 and config.rope_scaling is None
    assert config.max_position_embeddings == 4096 and config.rms_norm_eps == 1e-6


def test_tiny_model_config_agrees_with_transformers(tiny_model_dir: Path) -> None:
    """transformers is the reference: our reading of config.json must equal its reading."""
    from transformers import AutoConfig

    ref = AutoConfig.from_pretrained(tiny_model_dir)
    ours = ModelConfig.from_pretrained(tiny_model_dir)
    rope_theta = getattr(ref, "rope_parameters", None) or {"rope_theta": ref.rope_theta}
    assert ours.rope_theta == rope_theta["rope_theta"]
    assert (ours.num_layers, ours.num_qo_heads, ours.num_kv_heads, ours.head_dim) == (
        ref.num_hidden_layers, ref.num_attention_heads, ref.num_key_value_heads, ref.head_dim)
    assert (ours.vocab_size, ours.hidden_size, ours.intermediate_size) == (
        ref.vocab_size, ref.hidden_size, ref.intermediate_size)
    assert ours.tie_word_embeddings == ref.tie_word_embeddings


def test_from_pretrained_reads_config_json_from_a_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_0_6B))
    config = ModelConfig.from_pretrained(tmp_path)
    assert config == ModelConfig.from_dict(QWEN3_0_6B)
    assert config.raw["torch_dtype"] == "bfloat16"  # every key stays reachable


def test_qwen3_0_6b_fields() -> None:
    config = ModelConfig.from_dict(QWEN3_0_6B)
    assert (config.num_layers, config.num_qo_heads, config.num_kv_heads) == (28, 16, 8)
    assert config.group_size == 2
    assert (config.q_size, config.kv_size) == (2048, 1024)
    assert config.bos_token_id == 151643 and config.eos_token_ids == (151645,)
    assert config.torch_dtype == "bfloat16" and not config.is_moe


@pytest.mark.parametrize("key", REQUIRED)
def test_missing_required_key_is_named(key: str) -> None:
    with pytest.raises(ConfigError, match=f"my/config.json: missing required key '{key}'"):
        ModelConfig.from_dict(without(MINIMAL, key), source="my/config.json")


def test_null_counts_as_missing() -> None:
    with pytest.raises(ConfigError, match="missing required key 'vocab_size'"):
        ModelConfig.from_dict(with_(MINIMAL, vocab_size=None))


@pytest.mark.parametrize("key, value", [
    ("hidden_size", "64"), ("num_hidden_layers", 2.0), ("num_attention_heads", True),
    ("rms_norm_eps", "1e-5"), ("tie_word_embeddings", 1), ("model_type", 3),
])
def test_wrong_type_is_named_with_its_value(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{key} must be .*got {value!r}"):
        ModelConfig.from_dict(with_(MINIMAL, **{key: value}))


def test_head_dim_defaults_to_hidden_size_over_heads() -> None:
    assert ModelConfig.from_dict(MINIMAL).head_dim == 64 // 4


def test_head_dim_from_config_wins_over_the_division() -> None:
    # Qwen3-0.6B: 1024 / 16 = 64, but its heads are 128 wide (q_proj maps 1024 -> 2048).
    assert ModelConfig.from_dict(QWEN3_0_6B).head_dim == 128


def test_head_dim_default_needs_an_even_split() -> None:
    message = r"hidden_size \(64\) is not divisible by num_attention_heads \(3\)"
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(with_(MINIMAL, num_attention_heads=3))


def test_missing_kv_heads_means_one_per_query_head() -> None:
    config = ModelConfig.from_dict(MINIMAL)
    assert config.num_kv_heads == config.num_qo_heads and config.group_size == 1


def test_query_heads_must_be_a_multiple_of_kv_heads() -> None:
    with pytest.raises(ConfigError, match=r"num_attention_heads \(16\) must be a multiple of "
                                          r"num_key_value_heads \(6\)"):
        ModelConfig.from_dict(with_(QWEN3_0_6B, num_key_value_heads=6))


@pytest.mark.parametrize("key, value", [("num_hidden_layers", 0), ("vocab_size", -1),
                                        ("head_dim", 63), ("rms_norm_eps", 0.0)])
def test_impossible_values_are_rejected(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(with_(QWEN3_0_6B, **{key: value}))


def test_both_rope_spellings_give_the_same_config() -> None:
    before_v5 = with_(MINIMAL, rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    from_v5 = without(MINIMAL, "rope_theta") | {
        "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}}
    a, b = ModelConfig.from_dict(before_v5), ModelConfig.from_dict(from_v5)
    assert a == b
    assert a.rope_theta == 5e5 and a.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert a.rotary_dim == a.head_dim


def test_default_rope_type_means_no_scaling() -> None:
    v5 = without(MINIMAL, "rope_theta") | {
        "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    assert ModelConfig.from_dict(v5).rope_scaling is None


@pytest.mark.parametrize("value, message", [(0, "must be in"), (0.0, "must be in"),
                                            ("0.5", "must be a number"),
                                            (True, "must be a number")])
def test_partial_rotary_factor_is_checked_whatever_its_spelling(value: object,
                                                                message: str) -> None:
    """A zero is a value to reject, not a missing key to default to 1."""
    for config in (with_(MINIMAL, partial_rotary_factor=value),
                   without(MINIMAL, "rope_theta") | {"rope_parameters": {
                       "rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": value}}):
        with pytest.raises(ConfigError, match=f"partial_rotary_factor.*{message}"):
            ModelConfig.from_dict(config)
    unset = ModelConfig.from_dict(with_(MINIMAL, partial_rotary_factor=None))
    assert unset.partial_rotary_factor == 1.0


def test_eos_may_be_one_id_or_a_list() -> None:
    assert ModelConfig.from_dict(with_(MINIMAL, eos_token_id=[1, 2])).eos_token_ids == (1, 2)
    assert ModelConfig.from_dict(with_(MINIMAL, eos_token_id=7)).eos_token_ids == (7,)
    assert ModelConfig.from_dict(MINIMAL).eos_token_ids == ()


def test_moe_fields_are_read_for_later_architectures() -> None:
    moe = ModelConfig.from_dict(with_(MINIMAL, num_experts=8, num_experts_per_tok=2,
                                      moe_intermediate_size=32, norm_topk_prob=True))
    assert moe.is_moe and (moe.num_experts, moe.num_experts_per_tok) == (8, 2)
    mixtral_style = ModelConfig.from_dict(with_(MINIMAL, num_local_experts=4,
                                                num_experts_per_tok=2))
    assert mixtral_style.num_experts == 4
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_dict(with_(MINIMAL, num_experts=4, num_experts_per_tok=5))


def test_nested_text_config_gets_a_hint() -> None:
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict({"model_type": "vlm", "text_config": MINIMAL})


def test_config_json_problems_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        ModelConfig.from_pretrained(tmp_path)


# ---------------------------------------------------------------- KV bytes per token

KV_CASES = {
    "qwen3-0.6b (GQA 16/8)": QWEN3_0_6B,
    "multi-head (4/4)": MINIMAL,
    "multi-query (8/1)": with_(MINIMAL, num_attention_heads=8, num_key_value_heads=1, head_dim=32),
    "gqa 32/8, 80 layers": with_(MINIMAL, hidden_size=8192, num_attention_heads=64,
                                 num_key_value_heads=8, num_hidden_layers=80),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(KV_CASES))
def test_kv_bytes_per_token_equals_the_bytes_of_one_tokens_kv_tensors(case, dtype) -> None:
    """Count the bytes torch would really allocate for one token's K and V in every layer."""
    raw = KV_CASES[case]
    config = ModelConfig.from_dict(raw)
    heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim", raw["hidden_size"] // heads)
    kv_heads = raw.get("num_key_value_heads", heads)
    one_token = [torch.empty(kv_heads, head_dim, dtype=dtype)
                 for _layer in range(raw["num_hidden_layers"]) for _k_or_v in ("k", "v")]
    assert config.kv_bytes_per_token(dtype) == sum(t.nbytes for t in one_token)
    assert config.kv_bytes_per_token(str(dtype)) == config.kv_bytes_per_token(dtype)


def test_kv_bytes_worked_numbers_from_the_chapter() -> None:
    qwen = ModelConfig.from_dict(QWEN3_0_6B)
    assert qwen.kv_bytes_per_token("bfloat16") == 2 * 28 * 8 * 128 * 2 == 114_688
    assert 4096 * qwen.kv_bytes_per_token("bfloat16") == 448 * 2**20
    tiny = with_(MINIMAL, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64)
    assert ModelConfig.from_dict(tiny).kv_bytes_per_token("float32") == 4096


def test_kv_bytes_rejects_an_unknown_dtype() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'int4'"):
        ModelConfig.from_dict(MINIMAL).kv_bytes_per_token("int4")


# ---------------------------------------------------------------- environment variables


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """os.environ without any MINISGL_* variable; restored after the test."""
    for name in [n for n in os.environ if n.startswith("MINISGL_")]:
        monkeypatch.delenv(name)
    return monkeypatch


def test_env_defaults_when_nothing_is_set(clean_env) -> None:
    assert read_env() == Env(log_level="INFO", cpu_kv_memory=256 * 2**20, cpu_threads=0,
                             disable_overlap=False, require_gpu=False)


@pytest.mark.parametrize("name, text, field, value", [
    ("MINISGL_LOG_LEVEL", "debug", "log_level", "DEBUG"),
    ("MINISGL_LOG_LEVEL", " Warning ", "log_level", "WARNING"),
    ("MINISGL_CPU_KV_MEMORY", "1048576", "cpu_kv_memory", 2**20),
    ("MINISGL_CPU_KV_MEMORY", "512MiB", "cpu_kv_memory", 512 * 2**20),
    ("MINISGL_CPU_KV_MEMORY", "1.5g", "cpu_kv_memory", 3 * 2**29),
    ("MINISGL_CPU_KV_MEMORY", "64 KB", "cpu_kv_memory", 64 * 1024),
    ("MINISGL_CPU_THREADS", "0", "cpu_threads", 0),
    ("MINISGL_CPU_THREADS", " 3 ", "cpu_threads", 3),
    ("MINISGL_DISABLE_OVERLAP", "yes", "disable_overlap", True),
    ("MINISGL_DISABLE_OVERLAP", "OFF", "disable_overlap", False),
    ("MINISGL_REQUIRE_GPU", "1", "require_gpu", True),
])
def test_env_good_values_are_parsed(clean_env, name, text, field, value) -> None:
    clean_env.setenv(name, text)
    assert getattr(read_env(), field) == value


@pytest.mark.parametrize("name, text, allowed", [
    ("MINISGL_LOG_LEVEL", "loud", "DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ("MINISGL_CPU_KV_MEMORY", "lots", "512MiB"),
    ("MINISGL_CPU_KV_MEMORY", "-1G", "512MiB"),
    ("MINISGL_CPU_KV_MEMORY", "0", "greater than zero"),
    ("MINISGL_CPU_THREADS", "-1", "threads >= 1"),
    ("MINISGL_CPU_THREADS", "many", "whole number of threads"),
    ("MINISGL_DISABLE_OVERLAP", "maybe", "true"),
])
def test_env_bad_value_names_variable_value_and_what_is_allowed(clean_env, name, text, allowed):
    clean_env.setenv(name, text)
    with pytest.raises(EnvError) as info:
        read_env()
    message = str(info.value)
    assert message.startswith(f"{name}={text!r} is not valid")
    assert allowed in message


def test_env_blank_value_means_default(clean_env) -> None:
    clean_env.setenv("MINISGL_LOG_LEVEL", "")
    assert read_env().log_level == "INFO"


def test_env_unknown_variable_warns_with_the_closest_name(clean_env) -> None:
    clean_env.setenv("MINISGL_LOG_LEVLE", "DEBUG")
    hint = "MINISGL_LOG_LEVLE is ignored; did you mean MINISGL_LOG_LEVEL"
    with pytest.warns(UserWarning, match=hint):
        read_env()


def test_env_accepts_an_explicit_mapping() -> None:
    assert read_env({"MINISGL_DISABLE_OVERLAP": "true"}).disable_overlap is True


def test_every_env_var_is_documented_and_has_a_field() -> None:
    names = [var.name for var in ENV_VARS]
    assert len(set(names)) == len(names)
    for var in ENV_VARS:
        assert var.name.startswith("MINISGL_") and len(var.help) > 20
        assert hasattr(read_env({}), var.field)


# ---------------------------------------------------------------- logging


@pytest.fixture
def restore_logging():
    yield
    configure_logging()  # back to the level the environment says


def test_log_level_comes_from_the_environment(clean_env, restore_logging, capsys) -> None:
    clean_env.setenv("MINISGL_LOG_LEVEL", "warning")
    configure_logging()
    log = get_logger("minisgl.test")
    log.info("quiet")
    log.warning("loud %d", 42)
    err = capsys.readouterr().err
    assert "quiet" not in err
    assert "WARNING" in err and "minisgl.test: loud 42" in err


def test_loggers_outside_the_package_share_its_format(restore_logging, capsys) -> None:
    configure_logging("DEBUG")
    log = get_logger("__main__")
    assert log.name == "minisgl.__main__"
    log.debug("hello")
    captured = capsys.readouterr()
    assert captured.out == ""  # stdout belongs to the program, not to the logs
    assert "DEBUG MainProcess] minisgl.__main__: hello" in captured.err


def test_bad_explicit_log_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="expected one of DEBUG"):
        configure_logging("chatty")


# ---------------------------------------------------------------- local path or hub id


@pytest.fixture
def fake_hub(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """Replace huggingface_hub.snapshot_download; record calls; 'download' into tmp_path."""
    import huggingface_hub

    calls: list[dict] = []

    def snapshot_download(**kwargs) -> str:
        calls.append(kwargs)
        local = tmp_path / "hub" / kwargs["repo_id"].replace("/", "--")
        local.mkdir(parents=True, exist_ok=True)
        (local / "config.json").write_text(json.dumps(QWEN3_0_6B))
        return str(local)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return calls


def test_local_directory_is_used_as_is_and_never_downloaded(fake_hub, tmp_path: Path) -> None:
    ckpt = tmp_path / "org" / "name"  # even a directory that looks like a hub id
    ckpt.mkdir(parents=True)
    (ckpt / "config.json").write_text(json.dumps(MINIMAL))
    assert resolve_model_path(str(ckpt)) == ckpt.resolve()
    assert resolve_model_path(ckpt) == ckpt.resolve()
    assert fake_hub == []


def test_tiny_model_resolves_locally(fake_hub, tiny_model_dir: Path) -> None:
    assert resolve_model_path(tiny_model_dir) == tiny_model_dir.resolve()
    assert fake_hub == []


def test_hub_id_is_downloaded_with_only_what_the_engine_reads(fake_hub, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no local "Qwen/" directory can shadow the id
    path = resolve_model_path("Qwen/Qwen3-0.6B")
    assert [call["repo_id"] for call in fake_hub] == ["Qwen/Qwen3-0.6B"]
    patterns = fake_hub[0]["allow_patterns"]
    assert {"*.safetensors", "*.json"} <= set(patterns) and "*.bin" not in patterns
    assert ModelConfig.from_pretrained(path).num_layers == 28


@pytest.mark.parametrize("text", ["", "not a model", "a/b/c", "/no/such/dir", "./missing",
                                  "../x/y", "org/", "org name/model"])
def test_nonsense_is_rejected_without_touching_the_hub(fake_hub, text: str) -> None:
    with pytest.raises(ModelPathError, match="neither an existing directory nor a Hugging Face"):
        resolve_model_path(text)
    assert fake_hub == []


def test_a_path_object_is_never_treated_as_a_hub_id(fake_hub, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelPathError):
        resolve_model_path(Path("Qwen/Qwen3-0.6B"))
    assert fake_hub == []


def test_a_file_or_a_directory_without_config_is_not_a_checkpoint(fake_hub, tmp_path) -> None:
    (tmp_path / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ModelPathError, match="is a file"):
        resolve_model_path(tmp_path / "weights.safetensors")
    with pytest.raises(ModelPathError, match="has no config.json"):
        resolve_model_path(tmp_path)
    assert fake_hub == []


def test_failed_download_says_what_was_tried(monkeypatch, tmp_path) -> None:
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("network is unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ModelPathError, match="not a local directory, and fetching it from the "
                                             "Hugging Face hub failed: OSError: network"):
        resolve_model_path("Qwen/Qwen3-0.6B")


@pytest.mark.parametrize("text", ["models/tiny-qwen3", "./models/tiny-qwen3", "/no/such/model",
                                  "checkpoints/mine"])
def test_a_missing_local_path_never_asks_the_hub_and_says_how_to_make_the_model(
        fake_hub, tmp_path, monkeypatch, text: str) -> None:
    monkeypatch.chdir(tmp_path)  # a fresh clone: no models/ yet; checkpoints/ exists here
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(ModelPathError) as info:
        resolve_model_path(text)
    message = str(info.value)
    assert "python tools/make_tiny_model.py" in message and "\n" not in message
    assert fake_hub == []


@pytest.mark.parametrize("text, expected", [
    ("Qwen/Qwen3-0.6B", True), ("meta-llama/Llama-3.2-1B", True), ("a_b/c.d-e", True),
    ("gpt2", False), ("a/b/c", False), ("/abs/path", False), ("./rel/x", False), ("a/..", False),
])
def test_looks_like_hub_id(text: str, expected: bool) -> None:
    assert looks_like_hub_id(text) is expected


def test_hf_module_does_not_import_the_hub_client_eagerly() -> None:
    assert "snapshot_download" not in vars(hf)


def test_importing_config_code_loads_neither_torch_nor_transformers() -> None:
    code = ("import sys, minisgl, minisgl.env, minisgl.models.config, minisgl.utils.hf; "
            "heavy = ('torch', 'transformers', 'huggingface_hub'); "
            "print(sorted(m for m in heavy if m in sys.modules))")
    root = Path(__file__).resolve().parent.parent  # the tree under test, not an installed copy
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.stdout.strip() == "[]"


def test_generation_config_adds_its_end_of_sequence_ids(tmp_path) -> None:
    # config.json names one EOS id; generation_config.json (what transformers.generate stops
    # on) names two. The engine must stop on both, config.json's first, with no repeats.
    (tmp_path / "config.json").write_text(json.dumps(with_(MINIMAL, eos_token_id=7)))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7, 9]}))
    assert ModelConfig.from_pretrained(tmp_path).eos_token_ids == (7, 9)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(ConfigError, match="generation_config.json"):
        ModelConfig.from_pretrained(tmp_path)
