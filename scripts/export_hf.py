"""Export a profile as a Hugging Face LlavaForConditionalGeneration checkpoint (for vLLM / SGLang).

    python scripts/export_hf.py --profile tiny --out exported/tiny
"""

from __future__ import annotations

import argparse
import sys

from medvqa.config import PROFILES, load_settings
from medvqa.hf_export import ExportError, export_llava, load_for_export


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="tiny")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    settings = load_settings(args.profile)
    model, decoder = load_for_export(settings)
    try:
        folder = export_llava(model, decoder, args.out, args.profile, settings.decoder.conversation_format)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Exported {args.profile} to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
