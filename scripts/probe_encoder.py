"""Where the answer is lost: the encoder's own answer head against the decoder, on the same held-out
yes/no questions (images no training step saw).

    python scripts/tune_closed.py --data vqa-rad:train slake:train pathvqa:DIR:train --holdout-percent 15 \
        --scores runs/tune-closed-scores.npz
    python scripts/probe_encoder.py --data vqa-rad:train slake:train pathvqa:DIR:train --holdout-percent 15 \
        --decoder-scores runs/tune-closed-scores.npz

The probe is the answer head trained with the encoder's medical stage (scripts/train_encoder.py): it
reads the same 16 pooled tokens the projector gives the decoder, and answers Yes or No by its two
logits. Both are scored with the question's own image and with another held-out question's image
(the pairing tune_closed.py uses). Prints a table by data spec and a JSON line; --by-kind splits
SLAKE's rows by the attribute a question names (medvqa/presuppose.py); --coverage 0.8 also says how
many questions the head would answer, and how many of those right, if it answered closed questions
itself with a confidence calibrated out of fold as the app's is.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from medvqa.answers import normalise  # noqa: E402
from medvqa.config import PROFILES, load_settings, resolve_path  # noqa: E402
from medvqa.datasets import load_specs, read_image  # noqa: E402
from medvqa.vision import EfficientNetLiteEncoder  # noqa: E402
from medvqa_train.data import held_out_split  # noqa: E402
from medvqa_train.medical import Heads  # noqa: E402


def probe_scores(examples, picked, encoder_path: str, heads_path: str) -> tuple[np.ndarray, np.ndarray]:
    """Yes-minus-No logit of the answer head for each picked question, with its own image and with
    the image of the question n/2 places on."""
    from medvqa.retrieval.embed import load_embedder
    from medvqa.answer_head import QUESTION_EMBEDDER

    with safe_open(heads_path, "pt") as handle:
        meta = handle.metadata()
    answers, organs = json.loads(meta["answers"]), json.loads(meta["organs"])
    heads = Heads(len(answers), len(organs))
    heads.load_state_dict(load_file(heads_path))
    heads.eval()
    yes, no = answers.index("yes"), answers.index("no")
    encoder = EfficientNetLiteEncoder(encoder_path, pooled_tokens=16)
    embedder = load_embedder(QUESTION_EMBEDDER, device="cpu")
    questions = torch.from_numpy(embedder.encode([examples[i].question for i in picked], batch_size=128))
    tokens: dict[Path, torch.Tensor] = {}
    for i in picked:
        image = examples[i].image
        if image not in tokens:
            tokens[image] = encoder.encode(encoder.preprocess([read_image(image)]))[0]
    own = torch.stack([tokens[examples[i].image] for i in picked])
    n = len(picked)
    other = own[[(k + n // 2) % n for k in range(n)]]
    with torch.no_grad():
        scores = []
        for grid in (own, other):
            logits = heads.answers(heads.image_heads(grid)["normed"], questions)
            scores.append((logits[:, yes] - logits[:, no]).numpy())
    return scores[0], scores[1]


def coverage(real: np.ndarray, truth: np.ndarray, images: list[str], source: np.ndarray, target: float) -> dict:
    """What the probe would answer if it answered closed questions itself: its |Yes - No| margin
    calibrated out of fold by image (calibrate_closed.py's folds, one draw, and threshold rule), the threshold
    chosen for `target` accuracy, and at it the share answered and their accuracy, by data spec."""
    from calibrate_closed import choose_threshold, out_of_fold, summary_at

    correct = (real > 0) == truth
    scores = {"margin": np.abs(real), "kind": np.asarray(["yes/no"] * len(real)), "correct": correct,
              "image": np.asarray(images)}
    confidence = out_of_fold(scores)
    chosen = choose_threshold(confidence, correct, target)
    print(f"probe answering itself, out of fold: threshold {chosen['min_confidence']} for {target:.0%} right")
    by_source = {}
    if chosen["met"]:
        for group in [*dict.fromkeys(source), "all"]:
            mask = source == group if group != "all" else np.ones(len(source), bool)
            by_source[group] = summary_at(confidence[mask], correct[mask], chosen["min_confidence"])
            print(f"  {group}: answers {by_source[group]['answered']:.1%} of {mask.sum()}, "
                  f"{by_source[group]['accuracy_answered']} right")
    return {**chosen, "by_source": by_source}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", default="offline", choices=sorted(PROFILES))
    parser.add_argument("--data", nargs="+", required=True, help="as given to train_projector.py")
    parser.add_argument("--holdout-percent", type=float, default=15.0, help="as given to train_encoder.py")
    parser.add_argument("--encoder", default=None, help="encoder weights (default: the profile's)")
    parser.add_argument("--heads", default=str(REPO / "weights" / "offline" / "encoder_heads.safetensors"))
    parser.add_argument("--decoder-scores", default=None, help="tune_closed.py --scores file for the same questions")
    parser.add_argument("--by-kind", action="store_true",
                        help="split SLAKE's rows by the attribute a question names (medvqa/presuppose.py)")
    parser.add_argument("--coverage", type=float, default=None, metavar="TARGET",
                        help="also calibrate the probe's margin out of fold (5 folds by image, as calibrate_closed.py "
                             "does for the decoder) and print the share of questions it would answer at TARGET "
                             "accuracy (e.g. 0.8), by data spec")
    args = parser.parse_args(argv)

    settings = load_settings(args.profile)
    encoder_path = args.encoder or resolve_path(settings.vision.name_or_path)
    examples, spec_of = [], []
    for k, spec in enumerate(args.data):
        from_spec = load_specs([spec])
        examples += from_spec
        spec_of += [spec.split(":")[0]] * len(from_spec)
    picked = held_out_split(examples, 0, False, 0, args.holdout_percent)[0]
    truth = np.asarray([normalise(examples[i].answer) == "yes" for i in picked])
    source = np.asarray([spec_of[i] for i in picked])
    if args.by_kind:  # SLAKE's yes/no questions that name one value, by attribute (medvqa/presuppose.py)
        from medvqa.presuppose import head_kind, presupposition

        kinds = [head_kind(presupposition(examples[i].question)) for i in picked]
        source = np.asarray([f"{spec} {kind}" if spec == "slake" else spec for spec, kind in zip(source, kinds)])
    real, shuffled = probe_scores(examples, picked, encoder_path, args.heads)
    rows = {"probe_real": (real > 0) == truth, "probe_shuffled": (shuffled > 0) == truth}
    if args.decoder_scores:
        from tune_closed import picks

        saved = dict(np.load(args.decoder_scores))
        if len(saved["answers"]) != len(picked) or list(saved["answers"]) != [normalise(examples[i].answer) for i in picked]:
            raise SystemExit(f"{args.decoder_scores} holds other questions; run tune_closed.py with the same "
                             "--data and --holdout-percent")
        bias = settings.decoder.yes_bias
        rows["decoder_real"] = (picks(saved["real"], bias) == "yes") == truth
        rows["decoder_shuffled"] = (picks(saved["shuffled"], bias) == "yes") == truth
    names = list(rows)
    print(f"held-out yes/no questions (images never trained on, {args.holdout_percent:g} % by content hash); "
          f"accuracy %")
    print("| data | n | yes % | " + " | ".join(name.replace("_", " ") for name in names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    table = {}
    for group in [*dict.fromkeys(source), "all"]:
        mask = source == group if group != "all" else np.ones(len(source), bool)
        figures = {name: round(100 * float(rows[name][mask].mean()), 1) for name in names}
        table[group] = {"n": int(mask.sum()), "yes": round(100 * float(truth[mask].mean()), 1), **figures}
        print(f"| {group} | {mask.sum()} | {table[group]['yes']} | " + " | ".join(str(figures[n]) for n in names) + " |")
    result = {"holdout_percent": args.holdout_percent, "encoder": str(encoder_path), "table": table}
    if args.coverage is not None:
        result["coverage"] = coverage(real, truth, [str(examples[i].image) for i in picked], source, args.coverage)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
