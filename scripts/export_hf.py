"""Export a profile as a Hugging Face LlavaForConditionalGeneration checkpoint (for vLLM / SGLang).

    python scripts/export_hf.py --profile llava-med --out exported/llava-med
    python scripts/export_hf.py --profile tiny-llava-med --out exported/tiny --dtype float32

Weights in fp16 (as LLaVA-Med's reference runs) unless --dtype float32 (exact comparisons); what else
the folder carries is in medvqa/hf_export.py.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from medvqa.config import PROFILES, load_settings
from medvqa.hf_export import ExportError, export_llava, load_for_export


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="tiny")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", choices=("float16", "float32"), default="float16")
    args = parser.parse_args(argv)
    settings = load_settings(args.profile)
    model, decoder = load_for_export(settings)
    try:
        folder = export_llava(model, decoder, args.out, args.profile, settings.decoder.conversation_format,
                              dtype=getattr(torch, args.dtype))
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    image_token_id = json.loads((folder / "config.json").read_text())["image_token_index"]
    print(f"Exported {args.profile} to {folder}")
    print(f"Served by vLLM through the app's openai engine, set "
          f"MEDVQA_DECODER__REMOTE_IMAGE_TOKEN_ID={image_token_id} so no answer contains <image> "
          f"(vLLM does not read generation_config.json's suppress_tokens).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
