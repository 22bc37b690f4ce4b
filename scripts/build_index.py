"""Build (or extend) a retrieval index from JSONL corpus files.

    python scripts/build_index.py --corpus ../shared/data/corpus/*.jsonl --name default
    python scripts/build_index.py --corpus my_notes.jsonl --name default --append

Each corpus line is one JSON passage with at least `id`, `text` and `url` (an http(s) link a
clinician can open); `title`, `license` and `source` are optional. The index goes to
<index-dir>/<name>/ (default index/<name>/) with a manifest; the app opens the one named by its
retrieval settings (index_name, default "default").

The FAISS type is chosen from the passage count and --memory-gb (printed with the reason). Passages
are embedded --shard-size at a time with a checkpoint: after an interruption, run the same command
again and it resumes. Millions of passages: embed on a GPU (a CUDA build of PyTorch) with
`--device cuda --batch-size 512`; the embedding rate is printed in passages/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


from medvqa.config import PROFILES, load_settings
from medvqa.retrieval import RetrievalError, build_index
from medvqa.retrieval.index import SHARD_SIZE
from medvqa.retrieval.plan import FAISS_TYPES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", nargs="+", required=True, metavar="FILE", help="JSONL corpus files")
    parser.add_argument("--name", required=True, help="index name (folder under --index-dir)")
    parser.add_argument("--index-dir", default=None, help="parent folder of indexes (default: settings)")
    parser.add_argument("--profile", choices=PROFILES, default=None, help="settings profile (embedder)")
    parser.add_argument("--embedder", default=None, help="query embedder (default: the profile's)")
    parser.add_argument("--passage-embedder", default=None, help="passage embedder when it differs")
    parser.add_argument("--append", action="store_true", help="add the files to an existing index")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing index")
    parser.add_argument("--faiss-type", choices=FAISS_TYPES, default=None,
                        help="default: by corpus size and --memory-gb")
    parser.add_argument("--memory-gb", type=float, default=None,
                        help="memory the index may take (default: half of this machine's)")
    parser.add_argument("--shard-size", type=int, default=SHARD_SIZE, help="passages embedded between checkpoints")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--device", default=None, help="embedder device (default: settings)")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    config = load_settings(args.profile).retrieval
    index_dir = Path(args.index_dir or config.index_dir) / args.name
    started = time.perf_counter()
    try:
        path = build_index(
            args.corpus, index_dir, args.embedder or config.embedder, append=args.append,
            overwrite=args.overwrite, faiss_type=args.faiss_type or config.faiss_type,
            progress=not args.quiet, batch_size=args.batch_size,
            passage_embedder=config.passage_embedder if args.passage_embedder is None else args.passage_embedder,
            pooling=config.pooling, device=args.device or config.device,
            chunk_tokens=config.chunk_tokens, chunk_overlap=config.chunk_overlap, normalize=config.normalize,
            passage_title=config.passage_title, shard_size=args.shard_size,
            memory_bytes=None if args.memory_gb is None else int(args.memory_gb * 2**30))
    except RetrievalError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - started
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    manifest = json.loads((path / "manifest.json").read_text())
    print(f"Index {path}: {manifest['count']} passages, {manifest['faiss_type']} {manifest['faiss_params']}, "
          f"{size / 2**20:.1f} MiB, built in {elapsed:.1f} s.\nChosen: {manifest['faiss_choice']}")
    if args.name != config.index_name:
        print(f"To use it, set the retrieval index name: MEDVQA_RETRIEVAL__INDEX_NAME={args.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
