"""Train the projector (the only trained part); the encoder and decoder stay frozen.

    python scripts/train_projector.py --profile offline --data vqa-rad:train slake:train \
        --epochs 1 --max-minutes 60 --out weights/offline

Writes OUT/projector.safetensors and OUT/card.json; OUT/checkpoint.pt lets an interrupted run resume
(--resume, with the same options: the checkpoint records them and refuses others). Image features are
cached on disk under the settings' cache folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from medvqa.config import PROFILES, load_settings
from medvqa.datasets import load_specs, read_image
from medvqa.device import pick_device
from medvqa.language_model import LanguageModel, hub_offline_env, save_plain_copy
from medvqa.model import build_projector
from medvqa.prompt import IMAGE_POSITIONS, PromptBuilder
from medvqa.vision import build_vision, encoder_sha256, pool_tokens
from medvqa_train.data import (FeatureCache, augmented, encoder_key, held_out_split, make_example,
                               shared_prefix_length, training_answer)
from medvqa_train.experimental import add_lora, attach_counterparts, merge_lora
from medvqa_train.resume import check_resume, run_options
from medvqa_train.loss import (Standardized, batch_loss, channel_statistics, lr_at, prefix_cache_tensors,
                               yes_no_accuracy)


# Options that may change when a run is resumed: how long it runs, how often it is watched, where it
# writes, how many threads it uses, where the --init file lies (checked by content). Every other option
# must match the checkpoint's (medvqa_train.resume).
FREE_ON_RESUME = ("resume", "max_minutes", "max_steps", "eval_every", "out", "threads", "init")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="offline")
    parser.add_argument("--data", nargs="+", default=["vqa-rad:train", "slake:train"],
                        help="DATASET:SPLIT pairs (vqa-rad, slake), pathvqa:DIR:train or jsonl:DIR:SPLIT")
    parser.add_argument("--out", default=None, help="output folder (default: the profile's weights folder)")
    parser.add_argument("--epochs", type=float, default=1.0)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=float, default=0.03, help="share of steps spent warming up")
    parser.add_argument("--tokens", type=int, default=None, help="image tokens (pooled); default: profile's")
    parser.add_argument("--hidden", type=int, default=None, help="projector bottleneck width")
    parser.add_argument("--standardize", action="store_true",
                        help="standardise each encoder channel with training-set statistics (folded into "
                             "the first layer when saved)")
    parser.add_argument("--match-text-scale", action="store_true",
                        help="scale the initial output layer so image tokens start at the norm of text embeddings")
    parser.add_argument("--val", type=int, default=0,
                        help="hold out this many closed yes/no training questions to watch accuracy on")
    parser.add_argument("--val-by-image", action="store_true",
                        help="hold out whole images instead: every question on randomly drawn images leaves "
                             "training, and their yes/no questions (at least --val) are watched")
    parser.add_argument("--holdout-percent", type=float, default=0.0,
                        help="hold out every question on the images scripts/train_encoder.py held out (by content "
                             "hash, this percentage); overrides --val and --val-by-image")
    parser.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    parser.add_argument("--init", default=None,
                        help="start from these projector weights (fine-tuning) instead of from scratch")
    parser.add_argument("--image-position", choices=IMAGE_POSITIONS, default=None,
                        help="where the prompt puts the image: before the question (as LLaVA; the default) or after "
                             "it; recorded in the projector file (default with --init: the init file's)")
    parser.add_argument("--closed-weight", type=float, default=0.0,
                        help="weight of a two-way Yes/No loss on yes/no questions, beside the token loss (the shipped "
                             "projector: 1.0, chosen on the training hold-out; docs/encoder.md)")
    parser.add_argument("--closed-data", type=int, nargs="+", default=None, metavar="K",
                        help="apply --closed-weight only to the yes/no questions of these --data specs "
                             "(1-based positions; default: all); the held-out watch is unchanged")
    parser.add_argument("--contrast-weight", type=float, default=0.0,
                        help="experimental (not shipped): weight of an image-reliance loss: each yes/no question is also asked with another "
                             "image of the batch, and its right answer must be likelier with its own image")
    parser.add_argument("--contrast-partner", choices=("batch", "counterfactual"), default="batch",
                        help="experimental: the other image of --contrast-weight: the next one in the batch, or one of "
                             "the 3 most similar training images asked the same question with another answer (open "
                             "questions too, by the answer's mean token log-probability; every --data spec, "
                             "whatever --closed-data says)")
    parser.add_argument("--contrast-margin", type=float, default=0.5,
                        help="how far (two-way log-probability) the own image must lead before that loss stops")
    parser.add_argument("--repeat", type=int, nargs="+", default=None, metavar="N",
                        help="experimental (not shipped): show each --data spec's training examples N times an epoch, one N per spec "
                             "(e.g. --data vqa-rad:train slake:train --repeat 2 1); held-out questions stay out")
    parser.add_argument("--limit", type=int, nargs="+", default=None, metavar="N",
                        help="use a fixed random sample of N questions of each --data spec (0: all), e.g. "
                             "--data vqa-rad:train slake:train pathvqa:DIR:train --limit 0 0 4000")
    parser.add_argument("--augment", type=int, default=0,
                        help="experimental (not shipped): augmented copies per image (crop, rotation, brightness, contrast); each step "
                             "shows an example the original or one of them")
    parser.add_argument("--drop-image", type=float, default=0.0, help="share of examples shown a blank image")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="experimental: also train LoRA adapters of this rank on the decoder's linear layers "
                             "(0: decoder frozen, as designed); the merged decoder is written to OUT/decoder")
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    parser.add_argument("--lora-lr", type=float, default=2e-4, help="peak learning rate of the adapters")
    parser.add_argument("--max-minutes", type=float, default=None, help="stop (and save) after this long")
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--resume", action="store_true",
                        help="continue from OUT/checkpoint.pt; refused unless the options match the interrupted "
                             "run's (--init by content), except " + ", ".join("--" + name.replace("_", "-")
                                                                              for name in FREE_ON_RESUME[1:-1]))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    repeat = args.repeat or [1] * len(args.data)
    limit = args.limit or [0] * len(args.data)
    if len(limit) != len(args.data) or min(limit) < 0:
        parser.error("--limit needs one whole number >= 0 for each --data spec")
    if len(repeat) != len(args.data) or min(repeat) < 1:
        parser.error("--repeat needs one whole number >= 1 for each --data spec")
    if args.closed_data and not all(1 <= k <= len(args.data) for k in args.closed_data):
        parser.error("--closed-data takes 1-based positions of --data specs")
    if args.init and (args.standardize or args.match_text_scale):
        parser.error("--init starts from trained weights: --standardize and --match-text-scale only "
                     "apply to a projector trained from scratch")

    if args.threads:
        torch.set_num_threads(args.threads)
    settings = load_settings(args.profile)
    if args.tokens is not None:
        settings.vision.pooled_tokens = args.tokens
    if args.hidden is not None:
        settings.projector.hidden_size = args.hidden
    settings.projector.weights = ""  # start from scratch (or the checkpoint)
    out = Path(args.out or Path(settings.projector.weights or f"weights/{args.profile}/x").parent)
    if args.out is None:
        out = Path(load_settings(args.profile).projector.weights).parent
    out.mkdir(parents=True, exist_ok=True)

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    hub_offline_env(settings.offline)
    device = pick_device(settings.device)
    dtype = torch.float32  # measured: bf16 autocast is several times slower on CPUs without native bf16
    vision = build_vision(settings.vision, device, dtype, settings.offline)
    decoder = LanguageModel.load(settings.decoder, device, dtype, settings.cache_dir, settings.offline, settings.profile)
    projector = build_projector(settings, vision.hidden_size, decoder.hidden_size).to(device)
    n_tokens = settings.vision.pooled_tokens or vision.grid_tokens
    projector_init_sha256 = None
    if args.init:
        projector.load(args.init)
        projector_init_sha256 = projector.sha256  # --init is recorded by content: a moved file is the same run
    image_position = args.image_position or projector.image_position
    builder = PromptBuilder(decoder.tokenizer, n_tokens, settings.decoder.context_window, reserve_for_answer=32,
                            image_position=image_position)

    examples, spec_of = [], []  # spec_of: which --data spec each example came from (--repeat)
    for k, spec in enumerate(args.data):
        from_spec = load_specs([spec])
        if limit[k] and limit[k] < len(from_spec):
            picked = sorted(random.Random(args.seed + 4 + k).sample(range(len(from_spec)), limit[k]))
            from_spec = [from_spec[i] for i in picked]
        examples += from_spec
        spec_of += [k] * len(from_spec)
    cache = FeatureCache(Path(settings.cache_dir) / "features", vision, encoder_key(vision, settings.vision))
    prefix = shared_prefix_length(builder)
    features_by_image: dict[Path, torch.Tensor] = {}
    views_by_image: dict[Path, tuple[torch.Tensor, ...]] = {}
    train = []
    for example in tqdm(examples, desc="image features", unit="q"):
        if example.image not in features_by_image:
            pixels = read_image(example.image)
            features_by_image[example.image] = cache.features(pixels)
            views_by_image[example.image] = tuple(cache.features(augmented(pixels, k)) for k in range(args.augment))
        item = make_example(builder, example, features_by_image[example.image], prefix)
        train.append(dataclasses.replace(item, views=views_by_image[example.image]))
    blank = cache.features(torch.zeros(64, 64, 3, dtype=torch.uint8).numpy())
    prefix_kv = prefix_cache_tensors(decoder, builder, prefix)
    adapters = add_lora(decoder.model, args.lora, args.lora_alpha) if args.lora else []
    if adapters:
        print(f"LoRA rank {args.lora} on the decoder: {sum(p.numel() for p in adapters):,} trained parameters")

    held_out, held_out_shuffled = [], []
    left_out_images: set = set()
    leaving: set = set()  # indices of the questions training leaves out
    choices = tuple(builder.tokenizer(training_answer(word), add_special_tokens=False)["input_ids"][0]
                    for word in ("yes", "no"))
    if args.val or args.holdout_percent:
        # A fixed sample of closed yes/no questions leaves the training set; accuracy on them with the
        # real image and with another held-out question's image shows whether the image is used.
        picked, left_out = held_out_split(examples, args.val, args.val_by_image, args.seed, args.holdout_percent)
        if args.val_by_image or args.holdout_percent:
            print(f"held out {len(left_out)} questions on {len({examples[i].image for i in left_out})} whole "
                  f"images; {len(picked)} of them are yes/no")
        held_out = [dataclasses.replace(train[i], views=()) for i in picked]
        held_out_shuffled = [dataclasses.replace(item, features=held_out[(k + len(held_out) // 2) % len(held_out)].features)
                             for k, item in enumerate(held_out)]
        leaving = set(left_out)
        left_out_images = {examples[i].image for i in left_out}
        train = [item for i, item in enumerate(train) if i not in leaving]
        spec_of = [spec for i, spec in enumerate(spec_of) if i not in leaving]
    if args.contrast_weight and args.contrast_partner == "counterfactual":
        kept = [i for i in range(len(examples)) if i not in leaving]
        train = attach_counterparts(train, [examples[i].question for i in kept], [examples[i].answer for i in kept])
        paired = [item for item in train if item.counterparts]
        print(f"{len(paired)} training questions ({sum(item.contrast_answer >= 0 for item in paired)} yes/no) have "
              f"a counterpart image (same question, another answer)")
    if args.closed_data:  # the other specs' yes/no questions train on the token loss alone
        closed_specs = {k - 1 for k in args.closed_data}
        train = [item if spec in closed_specs else dataclasses.replace(item, yes_no=-1)
                 for item, spec in zip(train, spec_of)]
    if args.repeat:
        train = [item for item, spec in zip(train, spec_of) for _ in range(repeat[spec])]
        print(f"training examples per epoch with --repeat {' '.join(map(str, repeat))}: {len(train)}")

    if args.standardize:
        mean, std = channel_statistics(list(features_by_image.values()), n_tokens)
        projector = Standardized(projector, mean, std)
    if args.match_text_scale:
        with torch.no_grad():
            text_rms = decoder.model.get_input_embeddings().weight.float().pow(2).mean(-1).sqrt().mean()
            sample = pool_tokens(torch.stack([item.features for item in train[:64]]), n_tokens)
            image_rms = projector(sample).pow(2).mean(-1).sqrt().mean()
            inner = projector.projector if args.standardize else projector
            inner.linear_2.weight.mul_(text_rms / image_rms)
            inner.linear_2.bias.mul_(text_rms / image_rms)
        print(f"initial image-token RMS {image_rms:.3f} scaled to the text embeddings' {text_rms:.3f}")

    def watch(step: int) -> None:
        if not held_out:
            return
        projector.eval()
        if adapters:
            with torch.no_grad():
                prefix_kv[:] = prefix_cache_tensors(decoder, builder, prefix)
        real, yes_share = yes_no_accuracy(decoder, projector, held_out, prefix_kv, prefix, n_tokens, choices)
        shuffled, _ = yes_no_accuracy(decoder, projector, held_out_shuffled, prefix_kv, prefix, n_tokens, choices)
        projector.train()
        tqdm.write(json.dumps({"step": step, "held_out": len(held_out),
        "held_out_by_image": args.val_by_image or bool(args.holdout_percent), "yes_no_real": round(real, 4),
                               "yes_no_shuffled": round(shuffled, 4), "answered_yes": round(yes_share, 4)}))

    steps_per_epoch = len(train) // args.batch_size
    total_steps = max(1, int(steps_per_epoch * args.epochs))
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    warmup = max(1, int(total_steps * args.warmup))
    groups = [{"params": list(projector.parameters()), "peak": args.lr}]
    if adapters:
        groups.append({"params": adapters, "peak": args.lora_lr})
    optimizer = torch.optim.AdamW(groups, lr=args.lr, weight_decay=0.0)
    trained = [p for group in groups for p in group["params"]]
    step, elapsed_before, losses, drop_state = 0, 0.0, [], None
    checkpoint_path = out / "checkpoint.pt"
    # What decides this run's result, defaults made explicit; a resumed run must have the same.
    options = run_options(args, FREE_ON_RESUME, repeat=repeat, limit=limit,
                          closed_data=sorted(args.closed_data or range(1, len(args.data) + 1)),
                          tokens=n_tokens, hidden=settings.projector.hidden_size, image_position=image_position,
                          **{"--init file (SHA-256)": projector_init_sha256,
                             "encoder weights (SHA-256)": encoder_sha256(settings.vision)})
    command = "python " + " ".join(sys.argv)
    if args.resume and checkpoint_path.is_file():
        state = torch.load(checkpoint_path, weights_only=False)
        check_resume(state.get("options"), options, checkpoint_path, state.get("command"),
                     defaults=vars(parser.parse_args([])))
        projector.load_state_dict(state["projector"])
        if adapters:
            saved = state.get("lora") or {}
            unexpected = decoder.model.load_state_dict(saved, strict=False).unexpected_keys
            if unexpected or len(saved) != len(adapters):
                raise SystemExit(f"{checkpoint_path} holds no adapters of this shape; resume with the "
                                 f"--lora settings it was trained with")
        optimizer.load_state_dict(state["optimizer"])
        step, elapsed_before, losses = state["step"], state["elapsed"], state["losses"]
        random.setstate(state["python_rng"])
        drop_state = state.get("drop_rng")
        print(f"resumed at step {step}/{total_steps}")

    order_rng = random.Random(args.seed)
    orders = []  # a fixed shuffled order per epoch, so a resumed run sees the same batches
    for _ in range(int(args.epochs) + 1):
        order = list(range(len(train)))
        order_rng.shuffle(order)
        orders.append(order)
    drop_rng = random.Random(args.seed + 1)  # blank images and augmented views
    if drop_state is not None:
        drop_rng.setstate(drop_state)
    else:  # a checkpoint from before the state was saved: one draw per example, no views
        for _ in range(step * args.batch_size):
            drop_rng.random()

    if step == 0:
        watch(0)
    projector.train()
    started = time.time()
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step")
    stopped_early = False
    while step < total_steps:
        epoch, within = divmod(step, steps_per_epoch)
        indices = orders[epoch][within * args.batch_size:(within + 1) * args.batch_size]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total_steps, group["peak"], warmup)
        if adapters:  # the adapters change the shared prefix's keys and values too
            prefix_kv = prefix_cache_tensors(decoder, builder, prefix, grad=True)
        loss = batch_loss(decoder, projector, [train[i] for i in indices], prefix_kv, prefix, n_tokens,
                          blank, args.drop_image, drop_rng, args.closed_weight, choices,
                          args.contrast_weight, args.contrast_margin,
                          counterfactual=args.contrast_partner == "counterfactual")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if held_out and (step % args.eval_every == 0 or step == total_steps):
            watch(step)
        recent = sum(losses[-50:]) / len(losses[-50:])
        bar.set_postfix(loss=f"{recent:.3f}", lr=f"{optimizer.param_groups[0]['lr']:.1e}")
        bar.update(1)
        minutes = (elapsed_before + time.time() - started) / 60
        if step % 100 == 0 or step == total_steps or (args.max_minutes and minutes >= args.max_minutes):
            lora_state = {name: p.detach() for name, p in decoder.model.named_parameters() if "lora_" in name}
            torch.save({"projector": projector.state_dict(), "lora": lora_state,
                        "optimizer": optimizer.state_dict(), "step": step,
                        "elapsed": elapsed_before + time.time() - started, "losses": losses,
                        "python_rng": random.getstate(), "drop_rng": drop_rng.getstate(),
                        "options": options, "command": command}, checkpoint_path)
        if args.max_minutes and minutes >= args.max_minutes and step < total_steps:
            stopped_early = True
            break
    bar.close()

    wall = elapsed_before + time.time() - started
    card = {
        "profile": args.profile, "data": args.data, "examples": len(train), "steps": step,
        "planned_steps": total_steps, "epochs": round(step / max(1, steps_per_epoch), 3),
        "batch_size": args.batch_size, "lr": args.lr, "image_tokens": n_tokens, "image_position": image_position,
        "encoder": settings.vision.name_or_path, "encoder_sha256": encoder_sha256(settings.vision),
        "projector": {"vision": vision.hidden_size, "hidden": settings.projector.hidden_size,
                      "text": decoder.hidden_size},
        "standardize": args.standardize, "match_text_scale": args.match_text_scale, "held_out": len(held_out),
        "held_out_by_image": args.val_by_image or bool(args.holdout_percent),
        "holdout_percent": args.holdout_percent or None,
        "held_out_images": len(left_out_images) if (args.val_by_image or args.holdout_percent) else None,
        "drop_image": args.drop_image, "augment": args.augment, "repeat": repeat, "limit": limit, "seed": args.seed, "init": args.init,
        "init_sha256": projector_init_sha256,
        "closed_weight": args.closed_weight, "closed_data": args.closed_data, "contrast_weight": args.contrast_weight,
        "contrast_partner": args.contrast_partner if args.contrast_weight else None,
        "contrast_margin": args.contrast_margin, "lora": args.lora,
        "lora_alpha": args.lora_alpha if args.lora else None, "lora_lr": args.lora_lr if args.lora else None,
        "final_loss": round(sum(losses[-50:]) / max(1, len(losses[-50:])), 4),
        "wall_minutes": round(wall / 60, 1), "stopped_by_time_budget": stopped_early,
        "command": command,
    }
    final = projector.folded() if args.standardize else projector
    final.save(out / "projector.safetensors",
               metadata={"image_tokens": n_tokens, "steps": step, "image_position": image_position,
                         "encoder_sha256": card["encoder_sha256"]})
    if adapters:
        merge_lora(decoder.model)
        save_plain_copy(decoder.model, decoder.tokenizer, out / "decoder")
        print(f"decoder with merged adapters written to {out / 'decoder'} "
              f"(use it with MEDVQA_DECODER__NAME_OR_PATH and the transformers engine)")
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card))


if __name__ == "__main__":
    main()
