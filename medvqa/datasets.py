"""VQA benchmarks as one list type: VQA-RAD, SLAKE (their own files) and a plain JSONL format.

JSONL format (any other benchmark converts to it): `DIR/SPLIT.jsonl`, one question a line with `image`
(file under `DIR/images/`), `question`, `answer`, `answer_type` (OPEN/CLOSED).

PathVQA (`pathvqa:DIR:train`) is read from the layout of the public BTIA-AD-Net repository's
`data/pathvqa` (`train.json` rows with `image_path`, images under `images/train/`) or from the JSONL
format. Its test split is this team's held-out set and is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SHARED_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


@dataclass(frozen=True)
class VQAExample:
    qid: str
    image: Path
    question: str
    answer: str
    answer_type: str  # "OPEN" or "CLOSED"


def load_examples(dataset: str, data_dir: str | Path | None, split: str) -> list[VQAExample]:
    if dataset == "vqa-rad":
        return _vqa_rad(Path(data_dir or SHARED_DATA / "vqa_rad"), split)
    if dataset == "slake":
        return _slake(Path(data_dir or SHARED_DATA / "slake"), split)
    if dataset == "pathvqa":
        if data_dir is None:
            raise ValueError("pathvqa needs its folder: pathvqa:DIR:train")
        if split == "test":
            raise ValueError("PathVQA test is held out (the maintainers measure on it); train on 'train'")
        return _pathvqa(Path(data_dir), split)
    if dataset == "jsonl":
        if data_dir is None:
            raise ValueError("--data DIR is required for the jsonl dataset")
        return _jsonl(Path(data_dir), split)
    raise ValueError(f"Unknown dataset {dataset!r}; use vqa-rad, slake, pathvqa or jsonl.")


def load_specs(specs: list[str]) -> list[VQAExample]:
    """Examples of several DATASET:SPLIT (vqa-rad, slake) or jsonl:DIR:SPLIT specs, in order."""
    examples = []
    for spec in specs:
        parts = spec.split(":")
        examples += load_examples(parts[0], parts[1] if len(parts) == 3 else None, parts[-1])
    return examples


def _vqa_rad(folder: Path, split: str) -> list[VQAExample]:
    files = {"train": "trainset.json", "test": "testset.json"}
    if split not in files:
        raise ValueError(f"VQA-RAD has splits {sorted(files)}, not {split!r}")
    rows = json.loads((folder / files[split]).read_text())
    return [VQAExample(str(row["qid"]), folder / "images" / row["image_name"], str(row["question"]).strip(),
                       str(row["answer"]).strip(), str(row["answer_type"]).strip().upper()) for row in rows]


def _slake(folder: Path, split: str) -> list[VQAExample]:
    rows = json.loads((folder / f"{split}.json").read_text())
    return [VQAExample(str(row["qid"]), folder / "imgs" / row["img_name"], str(row["question"]).strip(),
                       str(row["answer"]).strip(), str(row["answer_type"]).strip().upper())
            for row in rows if row.get("q_lang", "en") == "en"]


def _pathvqa(folder: Path, split: str) -> list[VQAExample]:
    path = folder / f"{split}.json"
    if not path.is_file():
        return _jsonl(folder, split)
    rows = json.loads(path.read_text())
    return [VQAExample(f"pathvqa-{split}-{number}", folder / Path(*str(row["image_path"]).replace("\\", "/").split("/")),
                       str(row["question"]).strip(), str(row["answer"]).strip(),
                       str(row["answer_type"]).strip().upper()) for number, row in enumerate(rows)]


def _jsonl(folder: Path, split: str) -> list[VQAExample]:
    path = folder / f"{split}.jsonl"
    examples = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            examples.append(VQAExample(str(row.get("qid", number)), folder / "images" / row["image"],
                                       str(row["question"]).strip(), str(row["answer"]).strip(),
                                       str(row["answer_type"]).strip().upper()))
        except (json.JSONDecodeError, KeyError) as error:
            raise ValueError(f"{path}, line {number}: {error}") from None
    return examples


def read_image(path: str | Path):
    """A benchmark image as the model sees an upload of it: decoded by the app's imaging module."""
    from .imaging import load_scan

    return load_scan(str(path)).pixels
