"""Organ-presence questions for the projector, from SLAKE's training annotations.

SLAKE asks "Does the picture contain liver?" about few organs per image (733 yes/no organ questions over
its 450 training images). The encoder's medical stage learnt organ presence from the organ boxes
(`detection.json`), but the frozen decoder, asked Yes against No, does not pass it on
(docs/encoder.md, "Where the answer is lost"). These questions give the projector's Yes/No loss
the same facts in SLAKE's own phrasing, for every training image:

- an organ is **present** when the image's `detection.json` has a box naming it, when one of the
  image's training questions asks about it and is answered Yes, or when a training answer about the
  image names it ("What is the largest organ in the picture?" — "Lung");
- an organ is **absent** when a training question about the image is answered No, or when no
  training image of the same body location (SLAKE's `location`) ever shows it (no liver in a head
  scan);
- any other organ is unknown and asked about nowhere (a chest CT's heart without a box may be there).

Only training images are read, and with `holdout_percent` (the script's default, 15) the images the
encoder and the projector hold out are skipped altogether.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path

from medvqa.answers import normalise
from medvqa.presuppose import ORGAN_SPELLINGS, ORGANS, presupposition

# SLAKE's phrasing ("Does the picture contain liver?" is most of its organ questions), organ in lower case.
TEMPLATES = ("Does the picture contain {organ}?", "Does this image contain {organ}?")


def _singular(words: str) -> str:
    return words[:-1] if words.endswith("s") and not words.endswith("us") else words


def organs_named(text: str) -> set[str]:
    """The ORGANS a box label or an answer names ("Right Lung" → Lung, "Left Eye" → Eyes,
    "Liver, Kidney" → both)."""
    found = set()
    for part in text.replace("/", ",").replace(" and ", ",").split(","):
        words = normalise(part)
        words = _singular(ORGAN_SPELLINGS.get(words, words))
        for organ in ORGANS:
            name = _singular(normalise(organ))
            if words == name or words.endswith(" " + name):
                found.add(organ)
    # "brain edema", "brain enhancing tumor": a lesion of the brain shows the brain
    if normalise(text).startswith("brain ") and "Brain Stem" not in found:
        found.add("Brain")
    return found


def organ_labels(slake: Path, annotations: Path | None, holdout_percent: float = 0.0) -> dict[str, dict]:
    """Per training image (its path relative to `slake/imgs`): location and organs present / absent.
    Images in the encoder's hold-out (`holdout_percent`, by content hash) are left out entirely, so
    their organs do not decide what another image's location shows."""
    from .medical import content_hash, held_out_hash

    rows = [row for row in json.loads((slake / "train.json").read_text()) if row.get("q_lang", "en") == "en"]
    held: dict[str, bool] = {}
    images: dict[str, dict] = {}
    for row in rows:
        if holdout_percent:
            if row["img_name"] not in held:
                held[row["img_name"]] = held_out_hash(content_hash(slake / "imgs" / row["img_name"]), holdout_percent)
            if held[row["img_name"]]:
                continue
        image = images.setdefault(row["img_name"], {"location": row.get("location", ""), "present": set(),
                                                     "absent": set()})
        answer = str(row["answer"]).strip()
        asked = presupposition(row["question"], ("organ",))
        if asked is not None:
            if normalise(answer) == "yes":
                image["present"].add(asked.target)
            elif normalise(answer) == "no":
                image["absent"].add(asked.target)
        elif row["answer_type"].strip().upper() == "OPEN" and "organ" in row["question"].lower():
            image["present"] |= organs_named(answer)
    if annotations is not None:
        for name, image in images.items():
            detection = annotations / Path(name).parent / "detection.json"
            if detection.is_file():
                for entry in json.loads(detection.read_text() or "[]"):
                    for label in entry:
                        image["present"] |= organs_named(label)
    for image in images.values():  # an explicit No on this image outweighs a box or an answer naming the organ
        image["present"] -= image["absent"]
    seen_at: dict[str, set[str]] = defaultdict(set)
    for image in images.values():
        seen_at[image["location"]] |= image["present"]
    for image in images.values():
        image["absent"] |= {organ for organ in ORGANS if organ not in seen_at[image["location"]]}
        image["absent"] -= image["present"]
    return images


def organ_questions(slake: Path, annotations: Path | None, per_image: int = 3, seed: int = 0,
                    holdout_percent: float = 0.0) -> list[dict]:
    """Up to `per_image` present and as many absent organs per image, as JSONL rows (`image` absolute)."""
    rng = random.Random(seed)
    rows = []
    for name, image in sorted(organ_labels(slake, annotations, holdout_percent).items()):
        present, absent = sorted(image["present"]), sorted(image["absent"])
        rng.shuffle(present)
        rng.shuffle(absent)
        count = min(per_image, len(present), len(absent))
        for organ, answer in [(o, "Yes") for o in present[:count]] + [(o, "No") for o in absent[:count]]:
            question = rng.choice(TEMPLATES).format(organ=organ.lower())
            rows.append({"qid": f"slake-organ-{len(rows)}", "image": str((slake / "imgs" / name).resolve()),
                         "question": question, "answer": answer, "answer_type": "CLOSED"})
    return rows
