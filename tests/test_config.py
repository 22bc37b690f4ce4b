"""Settings: profiles, overrides from a file and the environment, choices checked once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from medvqa.config import load_settings
from medvqa.model import embed_prompt, merge_image_features
from medvqa.pipeline import Conversation, Done, Sources, Token
from medvqa.projector import PREFIX, Projector, ProjectorShapeError, map_llava_med_projector

from .conftest import prompt_gate, require_shared_data


def _image(seed: int = 0, shape=(48, 40)) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (*shape, 3), dtype=np.uint8)


def test_settings_overrides_from_file_and_environment(tmp_path):
    config = tmp_path / "medvqa.json"
    config.write_text('{"decoder": {"max_new_tokens": 7}, "retrieval": {"top_k": 5}}')
    settings = load_settings("offline", config_file=config,
                             env={"MEDVQA_DECODER__TEMPERATURE": "0.5", "MEDVQA_RETRIEVAL__ENABLED": "false"})
    assert settings.decoder.max_new_tokens == 7 and settings.retrieval.top_k == 5
    assert settings.decoder.temperature == 0.5 and settings.retrieval.enabled is False
    with pytest.raises(ValueError, match="Unknown setting"):
        load_settings("offline", env={"MEDVQA_DECODER__NOPE": "1"})
    with pytest.raises(ValueError, match="Unknown profile"):
        load_settings("huge", env={})


def test_login_and_api_key_variables_are_not_read_as_settings():
    """MEDVQA_USERNAME / MEDVQA_PASSWORD (the app's login) and the openai engine's key variable are read
    where they are used; as setting overrides they would stop the app at start-up."""
    env = {"MEDVQA_USERNAME": "radiology", "MEDVQA_PASSWORD": "x", "MEDVQA_API_KEY": "k", "MEDVQA_NO_LLAMA": "1",
           "MEDVQA_DECODER__API_KEY_ENV": "MEDVQA_SERVER_KEY", "MEDVQA_SERVER_KEY": "k2"}
    settings = load_settings("offline", env=env)
    assert settings.decoder.api_key_env == "MEDVQA_SERVER_KEY"


def test_choices_are_checked_once_with_the_choices_named():
    with pytest.raises(ValueError, match=r"decoder.engine is 'vllm'; choose one of 'auto', 'transformers'"):
        load_settings("offline", env={"MEDVQA_DECODER__ENGINE": "vllm"})
    with pytest.raises(ValueError, match=r"retrieval.prompt_gate is 'sometimes'"):
        load_settings("tiny", env={"MEDVQA_RETRIEVAL__PROMPT_GATE": "sometimes"})
    assert load_settings("offline", env={"MEDVQA_DECODER__ENGINE": "llama.cpp"}).decoder.engine == "llama.cpp"


def test_every_setting_is_documented():
    """docs/configuration.md has a row for every field, in its section's table."""
    import dataclasses
    import re
    from pathlib import Path

    from medvqa import config

    text = (Path(__file__).resolve().parents[1] / "docs" / "configuration.md").read_text()
    sections = {}
    for block in re.split(r"^## ", text, flags=re.M)[1:]:
        heading = block.splitlines()[0]
        name = re.match(r"`(\w+)`", heading)
        sections[name.group(1) if name else heading.strip()] = block
    missing = []
    for field in dataclasses.fields(config.Settings):
        section = getattr(config, field.type, None) if isinstance(field.type, str) else field.type
        if dataclasses.is_dataclass(section):
            rows = sections.get(field.name, "")
            missing += [f"{field.name}.{inner.name}" for inner in dataclasses.fields(section)
                        if not re.search(rf"^\| `{inner.name}` \|", rows, flags=re.M)]
        elif not re.search(rf"^\| `{field.name}` \|", sections.get("Top-level fields", ""), flags=re.M):
            missing.append(field.name)
    assert not missing, f"no row in docs/configuration.md: {missing}"
