"""Write a checkpoint's first layers as a model of their own: a draft that shares its tokenizer.

    python tools/cut_model.py models/tiny-shakespeare --layers 2 --out /tmp/draft

The cut keeps the embedding, the first ``--layers`` decoder layers, the final norm and the
head, so it writes the same vocabulary and agrees with the whole model part of the time: what a
draft for speculative decoding (chapter 23) needs, with nothing to train. The tests and chapter
23's example use it to have a draft on the CPU; on a GPU the trained target has its own draft,
the whole tiny model.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

WEIGHTS = "model.safetensors"


def cut_layers(model_dir: str | Path, num_layers: int, out: str | Path) -> Path:
    """Write ``model_dir``'s first ``num_layers`` layers to ``out``; returns ``out``.

    Every file but the weights is copied as it is (tokenizer, chat template, generation
    settings); ``config.json`` says the new depth.
    """
    from safetensors.torch import load_file, save_file

    model_dir, out = Path(model_dir), Path(out)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    depth = config["num_hidden_layers"]
    if not 1 <= num_layers <= depth:
        raise ValueError(f"{model_dir} has {depth} layers: keep between 1 and {depth}, "
                         f"not {num_layers}")
    if not (model_dir / WEIGHTS).is_file():
        raise ValueError(f"{model_dir} has no single {WEIGHTS} to cut")
    out.mkdir(parents=True, exist_ok=True)
    for path in model_dir.iterdir():
        if path.is_file() and path.name not in (WEIGHTS, "config.json"):
            shutil.copy(path, out / path.name)
    config["num_hidden_layers"] = num_layers
    if "max_window_layers" in config:
        config["max_window_layers"] = min(config["max_window_layers"], num_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    weights = load_file(model_dir / WEIGHTS)
    kept = {name: w for name, w in weights.items()
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers}
    save_file(kept, out / WEIGHTS)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="the checkpoint to cut")
    parser.add_argument("--layers", type=int, required=True, help="how many layers to keep")
    parser.add_argument("--out", required=True, help="where to write the cut model")
    args = parser.parse_args(argv)
    try:
        out = cut_layers(args.model, args.layers, args.out)
    except ValueError as exc:
        parser.error(str(exc))
    print(f"wrote {out}: the first {args.layers} layer(s) of {args.model}")


if __name__ == "__main__":
    main()
