"""The offline encoder's medical stage: EfficientNet-Lite0 (ImageNet) trained on medical training images.

    python scripts/train_encoder.py --slake ../shared/data/slake --slake-annotations SLAKE_IMGS \
        --vqa-rad ../shared/data/vqa_rad --pathvqa PATHVQA_DIR --out weights/offline

SLAKE_IMGS is the `Slake/imgs` folder of github.com/Jana-SG/MedVQA-Datasets (only the training
images' `detection.json` are read); PATHVQA_DIR is `data/pathvqa` of
github.com/Abdallahkhale/Enhanced-BTIA-AD-Net-for-Medical-Visual-Question-Answering at commit
1a9a7902c1933687ac5c8021280f45d9f1cc9c5d (`train.json` and `images/train/`; its test split is never
read), or a folder in MedVQA's JSONL format (`train.jsonl`, `images/`). Test and validation splits
are never read.

The early blocks (stem and blocks 0..TRUNK-1, generic edges and textures) stay as ImageNet trained
them; their activations are computed once per image and view and cached under --work. The later
blocks and the 1280-channel head are trained with heads on the 4 x 4 pooled token grid the decoder
is given: an answer head (question embedding from the offline MiniLM, attention over the 16 tokens,
answers that occur at least --min-answer-count times), organ presence and organ-per-cell (SLAKE
boxes), modality and body region. Images whose content hash falls in the --holdout-percent hold-out
are never trained on (nor by train_projector.py --holdout-percent); the held-out figures are logged
after every epoch to OUT/encoder_log.jsonl and the last ones written to the card.

Writes OUT/encoder.safetensors (the whole network, efficientnet_lite_pytorch's key names),
OUT/encoder_heads.safetensors (the heads, for scripts/probe_encoder.py) and OUT/encoder_card.json.
An interrupted run resumes with --resume (a checkpoint is written after every epoch; it records the run's
options, the data and starting weights by content, and refuses a resume with others).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from medvqa.answer_head import QUESTION_EMBEDDER  # noqa: E402
from medvqa.answers import normalise  # noqa: E402
from medvqa.config import VisionConfig, resolve_path  # noqa: E402
from medvqa.datasets import SHARED_DATA, read_image  # noqa: E402
from medvqa.vision import EfficientNetLiteEncoder  # noqa: E402
from medvqa_train.medical import (GRID, Heads, ImageRecord, Tail, held_out_hash, load_pathvqa,  # noqa: E402
                                  load_slake, load_vqa_rad, organ_cells, trunk_forward)
from medvqa_train.resume import check_resume, run_options  # noqa: E402

IMAGENET = VisionConfig().name_or_path
OBJECTIVES = ("answer", "organs", "cells", "modality", "region")


# Options that may change when a run is resumed (how many threads, where the caches and the result go,
# where the data, organ boxes and starting weights lie: those are checked by content). Every other option must match
# the checkpoint's (medvqa_train.resume).
FREE_ON_RESUME = ("resume", "threads", "work", "out", "slake", "slake_annotations", "vqa_rad", "pathvqa",
                  "encoder_weights")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slake", default=str(SHARED_DATA / "slake"), help="SLAKE folder (train.json, imgs/)")
    parser.add_argument("--slake-annotations", default=None,
                        help="folder laid out as SLAKE's imgs/ holding xmlabN/detection.json (organ boxes)")
    parser.add_argument("--vqa-rad", default=str(SHARED_DATA / "vqa_rad"), help="VQA-RAD folder (trainset.json)")
    parser.add_argument("--pathvqa", default=None, help="PathVQA train folder (see above); omitted: none")
    parser.add_argument("--out", default=str(REPO / "weights" / "offline"))
    parser.add_argument("--work", default=None, help="cache of trunk activations and question embeddings "
                        "(default: ~/.cache/medvqa/encoder-stage)")
    parser.add_argument("--objectives", nargs="+", choices=OBJECTIVES, default=list(OBJECTIVES))
    parser.add_argument("--holdout-percent", type=float, default=15.0,
                        help="share of images (by content hash) never trained on, for every measurement")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-images", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate of the trained blocks")
    parser.add_argument("--head-lr", type=float, default=1e-3)
    parser.add_argument("--weight-decay", type=float, default=1e-4)
    parser.add_argument("--trunk", type=int, default=8, help="blocks kept as ImageNet trained them")
    parser.add_argument("--views", type=int, default=3, help="cached views per image: the image and VIEWS-1 "
                        "augmented copies (crop, rotation, brightness, contrast; never mirrored)")
    parser.add_argument("--frozen", action="store_true",
                        help="a baseline: train the heads only, on the ImageNet network as it is (no medical stage)")
    parser.add_argument("--min-answer-count", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--resume", action="store_true",
                        help="continue from the last epoch's checkpoint; refused unless the options (data and "
                             "starting weights by content) match the interrupted run's")
    parser.add_argument("--max-images", type=int, default=0, help="use only this many images (tests)")
    parser.add_argument("--encoder-weights", default=IMAGENET, help="starting weights (ImageNet)")
    return parser.parse_args(argv)


# ----------------------------------------------------------------------------------------------- data

def view_of(pixels: np.ndarray, key: str, view: int) -> np.ndarray:
    """View 0 is the image; view k > 0 a fixed random variation of it (medvqa_train.data.augmented)."""
    if view == 0:
        return pixels
    from medvqa_train.data import augmented

    return augmented(pixels, int(key[:8], 16) * 16 + view)


def question_embeddings(texts: list[str], work: Path) -> torch.Tensor:
    digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16]
    path = work / f"questions-{digest}.safetensors"
    if path.is_file():
        return load_file(str(path))["embeddings"]
    from medvqa.retrieval.embed import load_embedder

    vectors = torch.from_numpy(load_embedder(QUESTION_EMBEDDER, device="cpu").encode(texts, batch_size=128))
    save_file({"embeddings": vectors.contiguous()}, str(path))
    return vectors


def cached_trunk(records: list[ImageRecord], net: nn.Module, encoder: EfficientNetLiteEncoder, trunk: int,
                 views: int, work: Path) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """(views, N, C, 14, 14) float16 trunk activations and each image's (width, height)."""
    digest = hashlib.sha256(("\n".join(r.key for r in records) + f"|{trunk}|{views}").encode()).hexdigest()[:16]
    path = work / f"trunk-{digest}.safetensors"
    sizes_path = work / f"trunk-{digest}.json"
    if path.is_file() and sizes_path.is_file():
        return load_file(str(path))["trunk"], [tuple(s) for s in json.loads(sizes_path.read_text())]
    out, sizes = None, []
    batch: list[tuple[int, int, np.ndarray]] = []

    def flush() -> None:
        nonlocal out
        pixels = encoder.preprocess([image for _, _, image in batch])
        with torch.no_grad():
            acts = trunk_forward(net, pixels, trunk).to(torch.float16)
        if out is None:
            out = torch.empty((views, len(records), *acts.shape[1:]), dtype=torch.float16)
        for (view, index, _), act in zip(batch, acts):
            out[view, index] = act
        batch.clear()

    for index, record in enumerate(tqdm(records, desc="trunk activations", unit="image")):
        pixels = read_image(record.path)
        sizes.append((pixels.shape[1], pixels.shape[0]))
        for view in range(views):
            batch.append((view, index, view_of(pixels, record.key, view)))
        if len(batch) >= 48:
            flush()
    if batch:
        flush()
    save_file({"trunk": out.contiguous()}, str(path))
    sizes_path.write_text(json.dumps(sizes))
    return out, sizes


# ------------------------------------------------------------------------------------------- training

def build_targets(records, organ_names, sizes, answer_index, question_vectors, question_row):
    """Per image: organ presence (or None), cell targets (16, n_organs) (or None), modality, region;
    per question: (image index, embedding row, answer index or -1, closed, yes/no label or -1)."""
    images, questions = [], []
    for i, record in enumerate(records):
        organs = cells = None
        if record.organs is not None:
            organs = torch.zeros(len(organ_names))
            cells = torch.zeros(GRID * GRID, len(organ_names))
            for name, boxes in record.organs.items():
                if name in organ_names:
                    column = organ_names.index(name)
                    organs[column] = 1.0
                    for cell in organ_cells(boxes, *sizes[i]):
                        cells[cell, column] = 1.0
        images.append((organs, cells, record.modality, record.region))
        for question, answer, closed in record.questions:
            norm = normalise(answer)
            yes_no = ("yes", "no").index(norm) if norm in ("yes", "no") else -1
            questions.append((i, question_row[question], answer_index.get(norm, -1), closed, yes_no))
    return images, questions


def losses_for(tail_tokens, heads, image_ids, images, questions_by_image, question_vectors, objectives):
    out = heads.image_heads(tail_tokens)
    terms = {}
    organ_rows = [k for k, i in enumerate(image_ids) if images[i][0] is not None]
    if "organs" in objectives and organ_rows:
        target = torch.stack([images[image_ids[k]][0] for k in organ_rows])
        terms["organs"] = F.binary_cross_entropy_with_logits(out["organs"][organ_rows], target)
    if "cells" in objectives and organ_rows:
        target = torch.stack([images[image_ids[k]][1] for k in organ_rows])
        terms["cells"] = F.binary_cross_entropy_with_logits(out["cells"][organ_rows], target)
    for name, slot in (("modality", 2), ("region", 3)):
        rows = [k for k, i in enumerate(image_ids) if images[i][slot] >= 0]
        if name in objectives and rows:
            target = torch.tensor([images[image_ids[k]][slot] for k in rows])
            terms[name] = F.cross_entropy(out[name][rows], target)
    if "answer" in objectives:
        rows, embeds, targets = [], [], []
        for k, i in enumerate(image_ids):
            for (_, q_row, answer, _, _) in questions_by_image[i]:
                if answer >= 0:
                    rows.append(k)
                    embeds.append(q_row)
                    targets.append(answer)
        if rows:
            logits = heads.answers(out["normed"][rows], question_vectors[embeds])
            terms["answer"] = F.cross_entropy(logits, torch.tensor(targets))
    return terms, out


@torch.no_grad()
def evaluate(tail, heads, trunk_acts, image_ids, images, records, questions_by_image, question_vectors,
             yes_no_columns) -> dict:
    """Held-out figures: closed yes/no accuracy of the answer head (Yes against No) by source, open
    answers' exact accuracy, modality and region accuracy, organ presence accuracy (per label)."""
    tail.eval()
    heads.eval()
    stats: dict[str, list] = {}

    def add(name, value):
        stats.setdefault(name, []).append(float(value))

    for start in range(0, len(image_ids), 64):
        chunk = image_ids[start:start + 64]
        tokens = tail(trunk_acts[0, chunk].float())
        out = heads.image_heads(tokens)
        for k, i in enumerate(chunk):
            organs, _, modality, region = images[i]
            source = records[i].source
            if modality >= 0:
                add("modality", out["modality"][k].argmax().item() == modality)
            if region >= 0:
                add("region", out["region"][k].argmax().item() == region)
            if organs is not None:
                add("organs", ((out["organs"][k] > 0).float() == organs).float().mean())
            qs = questions_by_image[i]
            if not qs:
                continue
            logits = heads.answers(out["normed"][[k] * len(qs)], question_vectors[[q[1] for q in qs]])
            for (_, _, answer, closed, yes_no), row in zip(qs, logits):
                if yes_no >= 0:
                    right = int(row[yes_no_columns[1]] > row[yes_no_columns[0]]) == yes_no
                    add(f"yes_no_{source}", right)
                    add("yes_no", right)
                elif not closed:
                    add(f"open_exact_{source}", answer >= 0 and row.argmax().item() == answer)
    tail.train()
    heads.train()
    return {name: round(100 * sum(v) / len(v), 2) for name, v in sorted(stats.items())} | {
        "n_" + name: len(v) for name, v in sorted(stats.items()) if name in ("yes_no", "modality", "organs")}


def checkpoint_path(work: Path, out_dir: Path) -> Path:
    """The resumable state of a run writing to `out_dir` (kept in --work, not beside the weights)."""
    return work / f"checkpoint-{hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:10]}.pt"


def data_hashes(sources: list[Path]) -> dict[str, str]:
    """{"folder/file": SHA-256} of the question files read, as the card records them."""
    return {f"{Path(path).parent.name}/{Path(path).name}": hashlib.sha256(Path(path).read_bytes()).hexdigest()
            for path in sources}


def lr_scale(step: int, total: int, warmup: int) -> float:
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    started = time.time()
    out_dir, work = Path(args.out), Path(args.work or Path.home() / ".cache" / "medvqa" / "encoder-stage")
    out_dir.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    records_by_key: dict[str, ImageRecord] = {}
    sources = []
    if args.slake:
        load_slake(Path(args.slake), Path(args.slake_annotations) if args.slake_annotations else None, records_by_key)
        sources.append(Path(args.slake) / "train.json")
    if args.vqa_rad:
        load_vqa_rad(Path(args.vqa_rad), records_by_key)
        sources.append(Path(args.vqa_rad) / "trainset.json")
    if args.pathvqa:
        load_pathvqa(Path(args.pathvqa), records_by_key)
        sources.append(next(p for p in (Path(args.pathvqa) / "train.json", Path(args.pathvqa) / "train.jsonl")
                            if p.is_file()))
    records = sorted(records_by_key.values(), key=lambda r: r.key)
    if args.max_images:
        records = records[:args.max_images]
    held = [i for i, r in enumerate(records) if held_out_hash(r.key, args.holdout_percent)]
    train_ids = [i for i, r in enumerate(records) if not held_out_hash(r.key, args.holdout_percent)]
    print(f"{len(records)} images ({', '.join(f'{s}: {sum(r.source == s for r in records)}' for s in ('slake', 'vqa-rad', 'pathvqa'))}); "
          f"{len(held)} held out by content hash ({args.holdout_percent} %)")

    counts: dict[str, int] = {}
    for i in train_ids:
        for _, answer, _ in records[i].questions:
            counts[normalise(answer)] = counts.get(normalise(answer), 0) + 1
    answers = sorted(a for a, c in counts.items() if c >= args.min_answer_count or a in ("yes", "no"))
    for word in ("yes", "no"):
        if word not in answers:
            answers.append(word)
    answer_index = {a: k for k, a in enumerate(answers)}
    organ_names = sorted({name for i in train_ids if records[i].organs for name in records[i].organs})
    texts = sorted({q for r in records for q, _, _ in r.questions})
    question_row = {q: k for k, q in enumerate(texts)}
    question_vectors = question_embeddings(texts, work)
    print(f"{len(answers)} answers taught, {len(organ_names)} organs, {len(texts)} distinct questions")

    encoder = EfficientNetLiteEncoder(resolve_path(args.encoder_weights))
    net = encoder.net.eval()
    trunk_acts, sizes = cached_trunk(records, net, encoder, args.trunk, args.views, work)
    images, questions = build_targets(records, organ_names, sizes, answer_index, question_vectors, question_row)
    questions_by_image: list[list] = [[] for _ in records]
    for q in questions:
        questions_by_image[q[0]].append(q)

    tail = Tail(net, args.trunk)
    if args.frozen:
        tail.requires_grad_(False)
        tail.train = lambda mode=True: nn.Module.train(tail, False)  # batch norm keeps ImageNet statistics
        tail.eval()
    heads = Heads(len(answers), len(organ_names), question_vectors.shape[1])
    optimizer = torch.optim.AdamW([{"params": [p for p in tail.parameters() if p.requires_grad], "peak": args.lr},
                                   {"params": heads.parameters(), "peak": args.head_lr}],
                                  lr=args.lr, weight_decay=args.weight_decay)
    steps_per_epoch = max(1, len(train_ids) // args.batch_images)
    total = steps_per_epoch * args.epochs
    warmup = max(1, total // 20)
    epoch, elapsed_before, log = 0, 0.0, []
    checkpoint = checkpoint_path(work, out_dir)
    # What decides the result, the data and starting weights by content; a resumed run must have the same.
    start_sha256 = hashlib.sha256(Path(resolve_path(args.encoder_weights)).read_bytes()).hexdigest()
    organ_boxes = json.dumps([(r.key, r.organs) for r in records], sort_keys=True)  # from --slake-annotations
    options = run_options(args, FREE_ON_RESUME, **{
        "question files read (SHA-256)": data_hashes(sources),
        "organ boxes read (SHA-256)": hashlib.sha256(organ_boxes.encode()).hexdigest(),
        "--encoder-weights file (SHA-256)": start_sha256})
    command = "python " + " ".join(["scripts/train_encoder.py", *(argv if argv is not None else sys.argv[1:])])
    if args.resume and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        check_resume(state.get("options"), options, checkpoint, state.get("command"), defaults=vars(parse_args([])))
        tail.load_state_dict(state["tail"])
        heads.load_state_dict(state["heads"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, elapsed_before, log = state["epoch"], state["elapsed"], state["log"]
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed after epoch {epoch}")
    log_path = out_dir / "encoder_log.jsonl"
    tail.train()
    heads.train()
    yes_no_columns = (answer_index["yes"], answer_index["no"])
    resumed_at = time.time()
    while epoch < args.epochs:
        order_rng = random.Random(args.seed * 1000 + epoch)
        order = train_ids[:]
        order_rng.shuffle(order)
        sums: dict[str, float] = {}
        bar = tqdm(range(steps_per_epoch), desc=f"epoch {epoch + 1}/{args.epochs}", unit="step")
        for within in bar:
            step = epoch * steps_per_epoch + within
            for group in optimizer.param_groups:
                group["lr"] = group["peak"] * lr_scale(step, total, warmup)
            ids = order[within * args.batch_images:(within + 1) * args.batch_images]
            views = [order_rng.randrange(args.views) for _ in ids]
            tokens = tail(trunk_acts[views, ids].float())
            terms, _ = losses_for(tokens, heads, ids, images, questions_by_image, question_vectors, args.objectives)
            loss = sum(terms.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(list(tail.parameters()) + list(heads.parameters()), 5.0)
            optimizer.step()
            for name, value in terms.items():
                sums[name] = sums.get(name, 0.0) + value.item()
            bar.set_postfix({name: f"{value / (within + 1):.3f}" for name, value in sums.items()})
        epoch += 1
        figures = evaluate(tail, heads, trunk_acts, held, images, records, questions_by_image, question_vectors,
                           yes_no_columns)
        entry = {"epoch": epoch, "train_loss": {k: round(v / steps_per_epoch, 4) for k, v in sums.items()},
                 "held_out": figures, "minutes": round((elapsed_before + time.time() - resumed_at) / 60, 1)}
        log.append(entry)
        print(json.dumps(entry), flush=True)
        with log_path.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
        torch.save({"tail": tail.state_dict(), "heads": heads.state_dict(), "optimizer": optimizer.state_dict(),
                    "epoch": epoch, "elapsed": elapsed_before + time.time() - resumed_at, "log": log,
                    "torch_rng": torch.get_rng_state(), "options": options, "command": command}, checkpoint)

    # The whole network: the ImageNet trunk as it was, the trained tail in its place.
    state = {k: v.clone() for k, v in net.state_dict().items()}
    for name, value in tail.state_dict().items():
        if name.startswith("blocks."):
            index, rest = name[len("blocks."):].split(".", 1)
            state[f"_blocks.{int(index) + args.trunk}.{rest}"] = value
        else:
            prefix = {"conv_head": "_conv_head", "bn1": "_bn1"}[name.split(".", 1)[0]]
            state[prefix + "." + name.split(".", 1)[1]] = value
    state = {k: v.contiguous() for k, v in state.items()}
    save_file(state, str(out_dir / "encoder.safetensors"), metadata={"kind": "efficientnet_lite0"})
    encoder_digest = hashlib.sha256((out_dir / "encoder.safetensors").read_bytes()).hexdigest()
    # The heads name the encoder they read (the app refuses them beside another: medvqa/answer_head.py).
    save_file({k: v.contiguous() for k, v in heads.state_dict().items()}, str(out_dir / "encoder_heads.safetensors"),
              metadata={"answers": json.dumps(answers), "organs": json.dumps(organ_names),
                        "trunk": str(args.trunk), "encoder_sha256": encoder_digest})
    wall = elapsed_before + time.time() - resumed_at
    card = {
        "what": "EfficientNet-Lite0 with a medical stage: the offline profile's image encoder (frozen after this)",
        "start": args.encoder_weights,
        "start_sha256": start_sha256,
        "encoder_sha256": encoder_digest,
        "data": data_hashes(sources),
        "images": {source: sum(r.source == source for r in records) for source in ("slake", "vqa-rad", "pathvqa")},
        "images_sha256": hashlib.sha256("\n".join(r.key for r in records).encode()).hexdigest(),
        "slake_annotations": bool(args.slake_annotations),
        "held_out": {"by": "image content hash", "percent": args.holdout_percent, "images": len(held),
                     "images_sha256": hashlib.sha256("\n".join(records[i].key for i in held).encode()).hexdigest()},
        "objectives": args.objectives, "answers": len(answers), "organs": organ_names,
        "trained": ("nothing (--frozen: heads only, the ImageNet network)" if args.frozen else
                    f"blocks {args.trunk}-15 and the head convolution; stem and blocks 0-{args.trunk - 1} as ImageNet"),
        "epochs": args.epochs, "batch_images": args.batch_images, "views": args.views, "lr": args.lr,
        "head_lr": args.head_lr, "weight_decay": args.weight_decay, "seed": args.seed, "threads": args.threads,
        "wall_minutes_training": round(wall / 60, 1),
        "wall_minutes_total_this_run": round((time.time() - started) / 60, 1),
        "machine": "2-core AMD EPYC (AVX2), 24 GiB, CPU only, fp32",
        "held_out_figures": log[-1]["held_out"] if log else None,
        "command": command,
    }
    (out_dir / "encoder_card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card))
    return 0


if __name__ == "__main__":
    sys.exit(main())
