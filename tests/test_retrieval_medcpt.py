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


def _tiny_bert(folder, seed: int):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    core = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    core.normalizer = normalizers.BertNormalizer(lowercase=True)
    core.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    core.train_from_iterator([TEXT] * 4, trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], show_progress=False))
    cls_id, sep_id = core.token_to_id("[CLS]"), core.token_to_id("[SEP]")
    core.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", pad_token="[PAD]",
                                        cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]",
                                        model_max_length=512)
    torch.manual_seed(seed)
    BertModel(BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=512)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def medcpt(tmp_path_factory):
    """The llava-med profile's retrieval settings with tiny query and article encoders, and an index."""
    root = tmp_path_factory.mktemp("medcpt")
    query, article = _tiny_bert(root / "query", 1), _tiny_bert(root / "article", 2)
    corpus = root / "corpus.jsonl"
    rows = [{"id": f"p{i}", "title": title, "text": text, "url": f"https://pubmed.ncbi.nlm.nih.gov/{i}/"}
            for i, (title, text) in enumerate([
                ("Pleural effusion", "Fluid in the pleural space on a chest radiograph."),
                ("Cardiomegaly", "An enlarged heart on a chest radiograph."),
                ("Liver lesion", "A mass in the liver on CT of the abdomen."),
                ("Brain MRI", "A lesion in the brain on MRI.")], start=1)]
    corpus.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = replace(load_settings("llava-med", env={}).retrieval, embedder=query, passage_embedder=article,
                     index_dir=str(root), index_name="medcpt", corpus=[str(corpus)], device="cpu")
    build_index(config.corpus, root / "medcpt", config.embedder, passage_embedder=config.passage_embedder,
                pooling=config.pooling, device="cpu", progress=False, normalize=config.normalize,
                passage_title=config.passage_title)
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
    for name, value in {"EMBEDDER": query, "PASSAGE_EMBEDDER": article, "INDEX_DIR": str(tmp_path),
                        "DEVICE": "cpu"}.items():
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
