"""MedCPT retrieval as ncbi/MedCPT's reference uses it, on tiny random BERT encoders of the same
shape of use (point 5 of the llava-med conformance): questions truncated at 64 tokens, [CLS] pooling,
articles encoded as [title, text] pairs, scores by raw inner product (no normalisation), and
relevance cut-offs that belong to the embedder (calibrated into the index manifest)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from medvqa.config import load_settings
from medvqa.retrieval import Retriever, build_index

TEXT = ("pleural effusion fluid lung chest radiograph heart enlarged cardiomegaly liver spleen kidney brain "
        "mass lesion ct mri scan left right upper lower lobe nodule fracture bone abdomen")


def _tiny_bert(folder, seed: int, cross_encoder: bool = False):
    """A tiny random BERT of MedCPT's classes: a BertTokenizer (WordPiece, trained here), and BertModel
    (query and article encoders) or BertForSequenceClassification with one label (the cross-encoder)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertConfig, BertForSequenceClassification, BertModel, BertTokenizerFast

    core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.train_from_iterator([TEXT] * 4, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    tokenizer = BertTokenizerFast(vocab=core.get_vocab(), model_max_length=512)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=512, num_labels=1)
    (BertForSequenceClassification if cross_encoder else BertModel)(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def medcpt(tmp_path_factory):
    """The llava-med profile's retrieval settings with tiny query and article encoders, and an index."""
    root = tmp_path_factory.mktemp("medcpt")
    query, article = _tiny_bert(root / "query", 1), _tiny_bert(root / "article", 2)
    cross = _tiny_bert(root / "cross", 3, cross_encoder=True)
    corpus = root / "corpus.jsonl"
    rows = [{"id": f"p{i}", "title": title, "text": text, "url": f"https://pubmed.ncbi.nlm.nih.gov/{i}/"}
            for i, (title, text) in enumerate([
                ("Pleural effusion", "Fluid in the pleural space on a chest radiograph."),
                ("Cardiomegaly", "An enlarged heart on a chest radiograph."),
                ("Liver lesion", "A mass in the liver on CT of the abdomen."),
                ("Brain MRI", "A lesion in the brain on MRI.")], start=1)]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = replace(load_settings("llava-med", env={}).retrieval, embedder=query, passage_embedder=article,
                     cross_encoder=cross, index_dir=str(root), index_name="medcpt", corpus=[str(corpus)],
                     device="cpu")
    build_index(config.corpus, root / "medcpt", config.embedder, passage_embedder=config.passage_embedder,
                pooling=config.pooling, device="cpu", progress=False, normalize=config.normalize,
                passage_title=config.passage_title, chunk_tokens=config.chunk_tokens)
    return config, query, article


def _cls(folder: str, texts, max_length: int) -> np.ndarray:
    """The reference: tokenizer(..., truncation=True, max_length=N), last_hidden_state[:, 0]."""
    from transformers import AutoTokenizer, BertModel

    tokenizer, model = AutoTokenizer.from_pretrained(folder), BertModel.from_pretrained(folder).eval()
    encoded = tokenizer(texts, truncation=True, padding=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        return model(**encoded).last_hidden_state[:, 0].numpy()


def test_the_llava_med_profile_uses_medcpt_as_its_reference_does():
    config = load_settings("llava-med", env={}).retrieval
    assert (config.pooling, config.normalize, config.query_max_tokens, config.passage_title) == ("cls", False, 64, True)
    assert config.chunk_tokens == 0 and config.cross_encoder == "ncbi/MedCPT-Cross-Encoder"
    offline = load_settings("offline", env={}).retrieval  # the offline profile keeps what it has
    assert offline.cross_encoder == "" and offline.chunk_tokens == 200


def test_questions_are_read_to_64_tokens_with_the_cls_vector(medcpt):
    config, query, _ = medcpt
    retriever = Retriever.open(config)
    question = " ".join(["pleural effusion in the left lower lobe"] * 30)  # far over 64 tokens
    ours = retriever.embedder.encode([question])[0]
    np.testing.assert_allclose(ours, _cls(query, [question], 64)[0], atol=1e-5)
    assert not np.allclose(ours, _cls(query, [question], 512)[0], atol=1e-3)  # the truncation matters


def test_articles_are_title_text_pairs_scored_by_raw_inner_product(medcpt):
    config, query, article = medcpt
    retriever = Retriever.open(config)
    expected = _cls(article, [["Pleural effusion", "Fluid in the pleural space on a chest radiograph."]], 512)[0]
    stored = retriever._vectors([0])[0]
    np.testing.assert_allclose(stored, expected, atol=1e-5)
    assert abs(float(np.linalg.norm(stored)) - 1.0) > 1e-3  # not normalised
    found = retriever.search("pleural effusion on a chest radiograph", k=4)
    assert found  # no MiniLM cut-offs apply to inner products: the fused top-k is cited
    question_vector = retriever.embedder.encode(["pleural effusion on a chest radiograph"])[0]
    dense = retriever.rank("pleural effusion on a chest radiograph")
    np.testing.assert_allclose(dense.dense_scores[0], max(retriever._vectors(list(range(4))) @ question_vector),
                               rtol=1e-4)


def test_an_index_built_another_way_is_refused(medcpt):
    from medvqa.retrieval import RetrievalError

    config, _, _ = medcpt
    with pytest.raises(RetrievalError, match="normalized"):
        Retriever.open(replace(config, normalize=True))


def test_calibrated_cut_offs_in_the_manifest_replace_the_profiles(medcpt, tmp_path):
    import shutil
    from pathlib import Path

    config, _, _ = medcpt
    copy = tmp_path / "medcpt"
    shutil.copytree(Path(config.index_dir) / config.index_name, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["thresholds"] = {"min_dense_score": 1e9}  # nothing reaches it
    (copy / "manifest.json").write_text(json.dumps(manifest))
    calibrated = Retriever.open(replace(config, index_dir=str(tmp_path)))
    assert calibrated.thresholds["min_dense_score"] == 1e9
    assert calibrated.thresholds["relevance_margin"] == config.relevance_margin  # the rest from the profile
    assert calibrated.search("pleural effusion on a chest radiograph") == []


def test_the_calibration_script_writes_cut_offs_the_retriever_uses(medcpt, tmp_path, monkeypatch, capsys):
    import shutil
    from pathlib import Path

    from .conftest import load_script

    config, query, article = medcpt
    shutil.copytree(Path(config.index_dir) / config.index_name, tmp_path / "medcpt")
    data = tmp_path / "bench"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps({"image": "x.png", "question": q, "answer": "yes",
                                                          "answer_type": "CLOSED"}) + "\n"
                                              for q in ("Is there a pleural effusion?", "Is the heart enlarged?",
                                                        "Is there a liver lesion?", "Is there a brain mass?")))
    for name, value in {"EMBEDDER": query, "PASSAGE_EMBEDDER": article, "CROSS_ENCODER": config.cross_encoder,
                        "INDEX_DIR": str(tmp_path), "DEVICE": "cpu"}.items():
        monkeypatch.setenv(f"MEDVQA_RETRIEVAL__{name}", value)
    script = load_script("calibrate_retrieval")
    assert script.main(["--profile", "llava-med", "--data", f"jsonl:{data}:train", "--write"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["on_topic"]["best_passage"]["n"] == 4 and result["off_topic"]["topic"]["n"] == len(script.OFF_TOPIC)
    manifest = json.loads((tmp_path / "medcpt" / "manifest.json").read_text())
    assert set(manifest["thresholds"]) == {"min_topic_score", "strong_match_score", "min_dense_score",
                                           "relevance_margin"}
    retriever = Retriever.open(replace(config, index_dir=str(tmp_path)))
    assert retriever.thresholds["min_dense_score"] == pytest.approx(result["proposal"]["min_dense_score"], abs=1e-4)


# --- articles whole, and the cross-encoder ---------------------------------------------------------

LONG_TEXT = " ".join(["Fluid in the pleural space on a chest radiograph with an enlarged heart."] * 80)


def test_articles_are_encoded_whole_and_truncated_by_the_encoder_as_medcpt_does(tmp_path):
    """chunk_tokens 0: a text far over 512 tokens is one passage, its vector the reference's
    tokenizer([[title, text]], truncation=True, max_length=512) [CLS] vector."""
    query, article = _tiny_bert(tmp_path / "query", 1), _tiny_bert(tmp_path / "article", 2)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "long", "title": "Effusion", "text": LONG_TEXT,
                                  "url": "https://pubmed.ncbi.nlm.nih.gov/9/"}) + "\n")
    config = replace(load_settings("llava-med", env={}).retrieval, embedder=query, passage_embedder=article,
                     cross_encoder="", index_dir=str(tmp_path), index_name="whole", device="cpu")
    build_index([str(corpus)], tmp_path / "whole", query, passage_embedder=article, pooling="cls", device="cpu",
                progress=False, normalize=False, passage_title=True, chunk_tokens=config.chunk_tokens)
    retriever = Retriever.open(config)
    assert len(retriever) == 1 and retriever.manifest["chunking"]["max_tokens"] == 0
    np.testing.assert_allclose(retriever._vectors([0])[0], _cls(article, [["Effusion", LONG_TEXT]], 512)[0],
                               atol=1e-5)
    with pytest.raises(Exception, match="whole texts"):  # a chunked configuration refuses the index
        Retriever.open(replace(config, chunk_tokens=200))


def _reference_cross_scores(folder: str, query: str, articles: list[str]) -> np.ndarray:
    """ncbi/MedCPT's README: pairs, truncation=True, padding=True, max_length=512, logits.squeeze(1)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.no_grad():
        encoded = tokenizer([[query, article] for article in articles], truncation=True, padding=True,
                            return_tensors="pt", max_length=512)
        return model(**encoded).logits.squeeze(dim=1).numpy()


def test_the_cross_encoder_reads_query_article_pairs_as_its_reference(medcpt):
    from transformers import AutoTokenizer

    from medvqa.retrieval.cross_encoder import article_text, load_cross_encoder

    config, _, _ = medcpt
    cross = load_cross_encoder(config.cross_encoder, "cpu")
    assert article_text("Pleural effusion", "Fluid.") == "Pleural effusion. Fluid."  # the README's "Title. Abstract"
    question = "Is there a pleural effusion?"
    articles = ["Pleural effusion. Fluid in the pleural space.", "Effusion. " + LONG_TEXT]
    encoded = cross.encode_pairs(question, articles)
    tokenizer = AutoTokenizer.from_pretrained(config.cross_encoder)
    expected = tokenizer([[question, a] for a in articles], truncation=True, padding=True, max_length=512,
                         return_tensors="pt")
    assert torch.equal(encoded["input_ids"], expected["input_ids"])
    assert encoded["input_ids"].shape[1] == 512  # its own truncation: the long article is cut ...
    question_ids = tokenizer(question)["input_ids"]
    assert encoded["input_ids"][1, :len(question_ids)].tolist() == question_ids  # ... the question stays whole
    assert encoded["token_type_ids"][1, :len(question_ids)].sum() == 0 and encoded["token_type_ids"][1, -1] == 1
    np.testing.assert_allclose(cross.score(question, articles),
                               _reference_cross_scores(config.cross_encoder, question, articles), atol=1e-5)


def test_the_cross_encoder_orders_the_fused_candidates(medcpt):
    config, _, _ = medcpt
    config = replace(config, duplicate_cosine=1.01)  # tiny random vectors: keep every passage
    retriever = Retriever.open(config)
    question = "pleural effusion on a chest radiograph"
    found = retriever.search(question, k=4)
    articles = {p.id: f"{p.title}. {p.text}" for p in found}
    scores = dict(zip(articles, _reference_cross_scores(config.cross_encoder, question, list(articles.values()))))
    assert [p.id for p in found] == sorted(scores, key=lambda pid: -scores[pid])
    assert [p.ranks["cross_encoder"] for p in found] == [1, 2, 3, 4]
    fused = [row for row, _, _ in retriever.rank(question).fused]
    assert sorted(fused) == [0, 1, 2, 3]  # every passage was a fused candidate, re-ranked
    without = Retriever.open(replace(config, cross_encoder=""))
    assert "cross_encoder" not in without.search(question, k=4)[0].ranks
