"""Download the default retrieval corpus (ROCO captions, PubMedQA abstracts) and write it as JSONL.

    python scripts/fetch_corpus.py                      # → ../shared/data/corpus/*.jsonl
    python scripts/fetch_corpus.py --out corpus/        # anywhere else
    python scripts/build_index.py --corpus corpus/*.jsonl --name default

For a machine without ../shared/data: it fetches the same two public datasets from their original
GitHub repositories at pinned commits, and writes `roco_captions.jsonl` and
`pubmed_abstracts.jsonl` in the format the index builder reads.

- pinned: every file comes from a fixed commit, never from a moving branch;
- verified: each download is checked against the git blob hash that the pinned commit's tree lists
  for that path (a content hash: a truncated, corrupted or substituted file is refused), and the
  SHA-256 of each JSONL written is printed;
- resumable: downloads go to `<out>/.downloads/` as `.part` files continued with HTTP range
  requests; verified files are not fetched again;
- progress: one progress bar a file.

ROCO captions whose figure has no Creative Commons licence ("NO-CC CODE") are skipped.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from tqdm.auto import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]

RAW_BASE = "https://raw.githubusercontent.com"
API_BASE = "https://api.github.com"
ROCO_REPO, ROCO_COMMIT = "razorx89/roco-dataset", "4a49cbf08fe5d5bca86f1d152595af7e3312bea1"
PUBMEDQA_REPO, PUBMEDQA_COMMIT = "pubmedqa/pubmedqa", "1f00b98d5cc626844bf8c4ca513b6e62c40071ec"
ROCO_SPLITS = ("train", "validation", "test")
ROCO_CATEGORIES = ("radiology", "non-radiology")
ROCO_FILES = ("captions.txt", "licences.txt", "dlinks.txt")
PUBMEDQA_FILE = "data/ori_pqal.json"
ROCO_SOURCE = "ROCO (PMC Open Access figure caption)"
PUBMEDQA_SOURCE = "PubMedQA PQA-L (PubMed abstract)"
CHUNK = 1 << 16


class FetchError(Exception):
    pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(REPO_ROOT.parent / "shared" / "data" / "corpus"),
                        help="folder for the JSONL files (default: ../shared/data/corpus)")
    parser.add_argument("--only", choices=("roco", "pubmedqa"), default=None, help="fetch one corpus")
    parser.add_argument("--force", action="store_true", help="replace existing JSONL files")
    parser.add_argument("--raw-base", default=RAW_BASE, help=argparse.SUPPRESS)  # tests: a loopback server
    parser.add_argument("--api-base", default=API_BASE, help=argparse.SUPPRESS)
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    try:
        written = fetch(Path(args.out), only=args.only, force=args.force, raw_base=args.raw_base,
                        api_base=args.api_base, progress=not args.quiet)
    except FetchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for path, count in written.items():
        print(f"{path}: {count} passages, sha256 {sha256_file(path)}")
    print("Next: python scripts/build_index.py --corpus " + " ".join(str(p) for p in written) + " --name default")
    return 0


def fetch(out: Path, *, only: str | None = None, force: bool = False, raw_base: str = RAW_BASE,
          api_base: str = API_BASE, progress: bool = True) -> dict[Path, int]:
    """Download, verify and convert; returns {jsonl path: passage count}."""
    out.mkdir(parents=True, exist_ok=True)
    targets = {"roco": out / "roco_captions.jsonl", "pubmedqa": out / "pubmed_abstracts.jsonl"}
    wanted = [only] if only else ["pubmedqa", "roco"]
    for name in wanted:
        if targets[name].exists() and not force:
            raise FetchError(f"{targets[name]} already exists; pass --force to replace it.")
    downloads = out / ".downloads"
    written: dict[Path, int] = {}
    if "pubmedqa" in wanted:
        files = download_repo_files(PUBMEDQA_REPO, PUBMEDQA_COMMIT, [PUBMEDQA_FILE], downloads,
                                    raw_base, api_base, progress)
        written[targets["pubmedqa"]] = write_jsonl(targets["pubmedqa"], pubmedqa_rows(files[PUBMEDQA_FILE]))
    if "roco" in wanted:
        paths = [f"data/{split}/{category}/{name}" for split in ROCO_SPLITS for category in ROCO_CATEGORIES
                 for name in ROCO_FILES]
        files = download_repo_files(ROCO_REPO, ROCO_COMMIT, paths, downloads, raw_base, api_base, progress)
        written[targets["roco"]] = write_jsonl(targets["roco"], roco_rows(files))
    return written


# --- download -------------------------------------------------------------------------------------

def download_repo_files(repo: str, commit: str, paths: list[str], downloads: Path, raw_base: str,
                        api_base: str, progress: bool) -> dict[str, Path]:
    """Fetch `paths` of `repo` at `commit`, each verified against the commit tree's blob hash."""
    expected = pinned_blob_hashes(repo, commit, api_base)
    found: dict[str, Path] = {}
    for path in paths:
        if path not in expected:
            raise FetchError(f"{path} is not in {repo} at commit {commit}.")
        target = downloads / repo.replace("/", "__") / commit / path
        if not (target.exists() and git_blob_sha1(target) == expected[path]):
            download(f"{raw_base.rstrip('/')}/{repo}/{commit}/{path}", target, progress)
            actual = git_blob_sha1(target)
            if actual != expected[path]:
                target.rename(target.with_name(target.name + ".corrupt"))
                raise FetchError(f"Checksum mismatch for {repo}/{path} at {commit}: git blob {actual}, "
                                 f"expected {expected[path]}. The file was set aside; run again to retry.")
        found[path] = target
    return found


def pinned_blob_hashes(repo: str, commit: str, api_base: str) -> dict[str, str]:
    url = f"{api_base.rstrip('/')}/repos/{repo}/git/trees/{commit}?recursive=1"
    tree = json.loads(http_get(url))
    if tree.get("truncated"):
        raise FetchError(f"The file list of {repo} at {commit} came back truncated; cannot verify downloads.")
    return {entry["path"]: entry["sha"] for entry in tree.get("tree", []) if entry.get("type") == "blob"}


def download(url: str, target: Path, progress: bool, attempts: int = 4) -> None:
    """Fetch `url` to `target` through `target.part`, resuming a partial file with a range request."""
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    for attempt in range(1, attempts + 1):
        have = part.stat().st_size if part.exists() else 0
        request = urllib.request.Request(url, headers={"User-Agent": "medvqa-fetch-corpus/1",
                                                       **({"Range": f"bytes={have}-"} if have else {})})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                resumed = response.status == 206
                if have and not resumed:
                    have = 0  # the server ignored the range: start over
                length = response.headers.get("Content-Length")
                total = have + int(length) if length is not None else None
                with open(part, "ab" if resumed else "wb") as handle, tqdm(
                        total=total, initial=have, unit="B", unit_scale=True, desc=target.name,
                        disable=not progress) as bar:
                    while block := response.read(CHUNK):
                        handle.write(block)
                        bar.update(len(block))
            os.replace(part, target)
            return
        except urllib.error.HTTPError as error:
            if error.code == 416 and have:  # range past the end: the part file is complete or bad
                os.replace(part, target)
                return
            if error.code in (403, 404) or attempt == attempts:
                raise FetchError(f"Download of {url} failed: HTTP {error.code} {error.reason}.") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
            if attempt == attempts:
                raise FetchError(f"Download of {url} failed after {attempts} attempts: {error}. "
                                 f"Run again to resume.") from None
        time.sleep(min(2 ** attempt, 10))


def http_get(url: str) -> bytes:
    request = urllib.request.Request(url, headers={"User-Agent": "medvqa-fetch-corpus/1",
                                                   "Accept": "application/vnd.github+json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.read()
    except (urllib.error.URLError, TimeoutError, ConnectionError) as error:
        raise FetchError(f"Could not read {url}: {error}.") from None


def git_blob_sha1(path: Path) -> str:
    """Git's object id of a file's content: sha1(b"blob <size>\\0" + content)."""
    digest = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


# --- conversion -----------------------------------------------------------------------------------

def pubmedqa_rows(path: Path):
    """PubMedQA PQA-L: one passage per abstract section, plus the conclusion (LONG_ANSWER)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    for pmid, record in data.items():
        common = {"pmid": pmid, "url": f"https://pubmed.ncbi.nlm.nih.gov/{pmid}/"}
        tail = {"question_title": record.get("QUESTION", ""), "mesh": record.get("MESHES", []),
                "year": record.get("YEAR", ""), "source": PUBMEDQA_SOURCE}
        labels = record.get("LABELS", [])
        for n, text in enumerate(record.get("CONTEXTS", [])):
            section = labels[n] if n < len(labels) else ""
            yield {"id": f"PMID{pmid}_c{n}", **common, "section": section, "text": text, **tail}
        if record.get("LONG_ANSWER"):
            yield {"id": f"PMID{pmid}_conclusion", **common, "section": "CONCLUSIONS",
                   "text": record["LONG_ANSWER"], **tail}


def roco_rows(files: dict[str, Path]):
    """ROCO captions with a Creative Commons licence, with their PMC article link."""
    for split in ROCO_SPLITS:
        for category in ROCO_CATEGORIES:
            folder = f"data/{split}/{category}"
            licences = _roco_licences(files[f"{folder}/licences.txt"])
            figures = _roco_figures(files[f"{folder}/dlinks.txt"])
            for line in files[f"{folder}/captions.txt"].read_text(encoding="utf-8").splitlines():
                roco_id, _, caption = line.partition("\t")
                roco_id, caption = roco_id.strip(), caption.strip()
                licence = licences.get(roco_id)
                if not roco_id or not caption or licence is None:
                    continue
                pmcid, figure = licence[0], figures.get(roco_id) or licence[1]
                yield {"id": roco_id, "source": ROCO_SOURCE, "pmcid": pmcid,
                       "url": f"https://www.ncbi.nlm.nih.gov/pmc/articles/{pmcid}/", "figure_file": figure,
                       "text": caption, "license": licence[2], "roco_split": split, "category": category,
                       "keywords": []}


def _roco_licences(path: Path) -> dict[str, tuple[str, str, str]]:
    """ROCO_ID → (PMC id, figure file, licence), for CC-licensed figures only."""
    found = {}
    reader = csv.reader(io.StringIO(path.read_text(encoding="utf-8")))
    for row in reader:
        if len(row) < 3 or row[0] == "ROCO_ID":
            continue
        roco_id, pmc_figure, licence = row[0].strip(), row[1].strip(), row[2].strip()
        if not licence.upper().startswith("CC") or not pmc_figure.startswith("PMC"):
            continue  # "NO-CC CODE": not redistributable
        pmcid, _, figure = pmc_figure.partition("_")
        found[roco_id] = (pmcid, figure, licence)
    return found


def _roco_figures(path: Path) -> dict[str, str]:
    figures = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        parts = line.split("\t")
        if len(parts) >= 3:
            figures[parts[0].strip()] = parts[2].strip()
    return figures


def write_jsonl(target: Path, rows) -> int:
    partial = target.with_name(target.name + ".tmp")
    count = 0
    with open(partial, "w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row, ensure_ascii=False) + "\n")
            count += 1
    if count == 0:
        partial.unlink()
        raise FetchError(f"No passages for {target}.")
    os.replace(partial, target)
    return count


if __name__ == "__main__":
    sys.exit(main())
