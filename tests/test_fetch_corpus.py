"""scripts/fetch_corpus.py against a GitHub look-alike served on loopback (no internet needed)."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

from medvqa.retrieval.corpus import read_passages

from .conftest import load_script

fetch_corpus = load_script("fetch_corpus")

PQAL = {
    "21645374": {"QUESTION": "Do mitochondria play a role in remodelling lace plant leaves?",
                 "CONTEXTS": ["Programmed cell death (PCD) is the regulated death of cells.",
                              "Mitochondrial dynamics were delineated into four categories."],
                 "LABELS": ["BACKGROUND", "RESULTS"], "MESHES": ["Mitochondria"], "YEAR": "2011",
                 "LONG_ANSWER": "Mitochondria move on transvacuolar strands.", "final_decision": "yes"},
    "16418930": {"QUESTION": "Is there a pleural effusion?", "CONTEXTS": ["A pleural effusion was drained."],
                 "LABELS": ["METHODS"], "MESHES": [], "YEAR": "2006", "LONG_ANSWER": ""},
}


def roco_files() -> dict[str, bytes]:
    files = {}
    for split in fetch_corpus.ROCO_SPLITS:
        for category in fetch_corpus.ROCO_CATEGORIES:
            base = f"{split}_{category}".replace("-", "")
            a, b = f"ROCO_{base}_1", f"ROCO_{base}_2"
            folder = f"data/{split}/{category}"
            files[f"{folder}/captions.txt"] = (
                f"{a}\t Chest radiograph showing a left pleural effusion ({split}).\n"
                f"{b}\t A figure without a Creative Commons licence.\n").encode()
            files[f"{folder}/licences.txt"] = (
                f"ROCO_ID,PMC_ID,CC\n{a},PMC1234567_fig-{base}.jpg,CC BY\n{b},PMC7654321_x.jpg,NO-CC CODE\n").encode()
            files[f"{folder}/dlinks.txt"] = (
                f"{a}\twget -r ftp://ftp.ncbi.nlm.nih.gov/pub/pmc/oa_package/69/93/PMC1234567.tar.gz -P /path"
                f"\tfig-{base}.jpg\n").encode()
    return files


class FakeGitHub:
    """Serves `/repos/<repo>/git/trees/<commit>` and `/raw/<repo>/<commit>/<path>` with range support."""

    def __init__(self):
        self.repos = {
            (fetch_corpus.PUBMEDQA_REPO, fetch_corpus.PUBMEDQA_COMMIT):
                {fetch_corpus.PUBMEDQA_FILE: json.dumps(PQAL).encode(), "README.md": b"pubmedqa"},
            (fetch_corpus.ROCO_REPO, fetch_corpus.ROCO_COMMIT): roco_files(),
        }
        self.corrupt: set[str] = set()  # paths served with a flipped byte
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                url = urlparse(self.path)
                fake.requests.append((url.path, self.headers.get("Range")))
                parts = url.path.strip("/").split("/")
                if parts[0] == "repos" and parts[3:5] == ["git", "trees"]:
                    files = fake.repos.get(("/".join(parts[1:3]), parts[5]))
                    if files is None:
                        return self.send_error(404)
                    tree = [{"path": p, "type": "blob", "sha": blob_sha(data)} for p, data in files.items()]
                    return self._send(200, json.dumps({"tree": tree, "truncated": False}).encode())
                if parts[0] == "raw":
                    files = fake.repos.get(("/".join(parts[1:3]), parts[3]), {})
                    path = "/".join(parts[4:])
                    if path not in files:
                        return self.send_error(404)
                    data = files[path]
                    if path in fake.corrupt:
                        data = bytes([data[0] ^ 1]) + data[1:]
                    header = self.headers.get("Range")
                    if header:
                        start = int(header.removeprefix("bytes=").split("-")[0])
                        return self._send(206, data[start:])
                    return self._send(200, data)
                self.send_error(404)

            def _send(self, status: int, body: bytes):
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fetch(self, out: Path, **kwargs):
        return fetch_corpus.fetch(out, raw_base=f"{self.base}/raw", api_base=self.base, progress=False, **kwargs)

    def raw_requests(self) -> list[tuple[str, str | None]]:
        return [r for r in self.requests if r[0].startswith("/raw/")]


def blob_sha(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


@pytest.fixture
def github():
    fake = FakeGitHub()
    yield fake
    fake.server.shutdown()
    fake.server.server_close()


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_fetch_writes_both_corpora(github, tmp_path):
    written = github.fetch(tmp_path)
    pubmed = read_rows(tmp_path / "pubmed_abstracts.jsonl")
    assert [row["id"] for row in pubmed] == ["PMID21645374_c0", "PMID21645374_c1", "PMID21645374_conclusion",
                                             "PMID16418930_c0"]
    assert pubmed[1]["section"] == "RESULTS" and pubmed[2]["section"] == "CONCLUSIONS"
    assert pubmed[0]["url"] == "https://pubmed.ncbi.nlm.nih.gov/21645374/"
    assert pubmed[0]["question_title"].startswith("Do mitochondria") and pubmed[0]["year"] == "2011"
    roco = read_rows(tmp_path / "roco_captions.jsonl")
    assert len(roco) == 6  # one CC caption per split and category; the NO-CC ones are skipped
    assert all(row["license"] == "CC BY" and row["pmcid"] == "PMC1234567" for row in roco)
    assert roco[0]["url"] == "https://www.ncbi.nlm.nih.gov/pmc/articles/PMC1234567/"
    assert roco[0]["figure_file"] == "fig-train_radiology.jpg" and roco[0]["roco_split"] == "train"
    assert written == {tmp_path / "pubmed_abstracts.jsonl": 4, tmp_path / "roco_captions.jsonl": 6}
    for path in written:  # what the index builder reads
        assert len(list(read_passages(path, lambda texts: [len(t.split()) for t in texts], 200, 40))) > 0


def test_pinned_commit_is_requested(github, tmp_path):
    github.fetch(tmp_path, only="pubmedqa")
    paths = [path for path, _ in github.requests]
    assert f"/repos/{fetch_corpus.PUBMEDQA_REPO}/git/trees/{fetch_corpus.PUBMEDQA_COMMIT}" in paths
    assert paths[-1] == f"/raw/{fetch_corpus.PUBMEDQA_REPO}/{fetch_corpus.PUBMEDQA_COMMIT}/data/ori_pqal.json"


def test_interrupted_download_resumes(github, tmp_path):
    data = github.repos[(fetch_corpus.PUBMEDQA_REPO, fetch_corpus.PUBMEDQA_COMMIT)][fetch_corpus.PUBMEDQA_FILE]
    target = (tmp_path / ".downloads" / fetch_corpus.PUBMEDQA_REPO.replace("/", "__") / fetch_corpus.PUBMEDQA_COMMIT
              / fetch_corpus.PUBMEDQA_FILE)
    target.parent.mkdir(parents=True)
    target.with_name(target.name + ".part").write_bytes(data[:100])  # as left by a dropped connection
    github.fetch(tmp_path, only="pubmedqa")
    assert github.raw_requests() == [(f"/raw/{fetch_corpus.PUBMEDQA_REPO}/{fetch_corpus.PUBMEDQA_COMMIT}/"
                                      f"{fetch_corpus.PUBMEDQA_FILE}", "bytes=100-")]
    assert target.read_bytes() == data
    # A second run finds every file verified and downloads nothing.
    github.requests.clear()
    github.fetch(tmp_path, only="pubmedqa", force=True)
    assert github.raw_requests() == []


def test_checksum_mismatch_is_refused(github, tmp_path):
    github.corrupt.add(fetch_corpus.PUBMEDQA_FILE)
    with pytest.raises(fetch_corpus.FetchError, match="Checksum mismatch for pubmedqa/pubmedqa/data/ori_pqal.json"):
        github.fetch(tmp_path, only="pubmedqa")
    assert not (tmp_path / "pubmed_abstracts.jsonl").exists()
    github.corrupt.clear()  # the next run retries and succeeds
    github.fetch(tmp_path, only="pubmedqa")
    assert (tmp_path / "pubmed_abstracts.jsonl").exists()


def test_existing_output_is_kept_without_force(github, tmp_path):
    (tmp_path / "roco_captions.jsonl").write_text("keep me\n")
    with pytest.raises(fetch_corpus.FetchError, match="--force"):
        github.fetch(tmp_path, only="roco")
    assert (tmp_path / "roco_captions.jsonl").read_text() == "keep me\n"


def test_command_line(github, tmp_path, capsys):
    code = fetch_corpus.main(["--out", str(tmp_path), "--raw-base", f"{github.base}/raw",
                              "--api-base", github.base, "--quiet"])
    assert code == 0
    out = capsys.readouterr().out
    assert "roco_captions.jsonl: 6 passages, sha256 " in out and "scripts/build_index.py --corpus" in out
