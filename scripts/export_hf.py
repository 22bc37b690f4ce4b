"""Export a profile as a Hugging Face LlavaForConditionalGeneration checkpoint (for vLLM / SGLang).

    python scripts/export_hf.py --profile tiny --out exported/tiny
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from medvqa.config import PROFILES, load_settings  # noqa: E402
from medvqa.export import ExportError, export_llava  # noqa: E402
from medvqa.pipeline import Pipeline  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profile", choices=PROFILES, default="tiny")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    pipeline = Pipeline.load(load_settings(args.profile), with_retrieval=False)
    try:
        folder = export_llava(pipeline, args.out)
    except ExportError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"Exported {args.profile} to {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
