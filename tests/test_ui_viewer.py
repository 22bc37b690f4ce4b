"""The viewer's HTML (medvqa/ui/viewer.py): what the page's zoom and ruler are told about the image shown."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np


def _scan(rows: int, columns: int, **meta):
    return SimpleNamespace(pixels=np.zeros((rows, columns, 3), np.uint8), safe_meta=meta)


def test_a_pixel_shown_measures_the_spacing_times_the_downscaling():
    from medvqa.ui.viewer import _measure_scale

    assert _measure_scale(_scan(512, 512, PixelSpacing="0.7\\0.7"), 512, 512) == "0.7,0.7,mm,"
    # Rows 0.5 mm apart, columns 0.8: a 2048 x 1024 scan shown at 1024 x 512.
    assert _measure_scale(_scan(2048, 1024, PixelSpacing="0.5\\0.8"), 512, 1024) == "1,1.6,mm,"
    # A radiograph's spacing at the detector is said to be so; Pixel Spacing (in the patient) comes first.
    assert _measure_scale(_scan(100, 100, ImagerPixelSpacing="0.2\\0.2"), 100, 100) == "0.2,0.2,mm,at the detector"
    assert _measure_scale(_scan(100, 100, PixelSpacing="0.18\\0.18", ImagerPixelSpacing="0.2\\0.2"), 100, 100) \
        == "0.18,0.18,mm,"
    # A radiograph's Pixel Spacing that merely repeats the imager's is not calibrated to the patient either.
    assert _measure_scale(_scan(100, 100, PixelSpacing="0.2\\0.2", ImagerPixelSpacing="0.2\\0.2"), 100, 100) \
        == "0.2,0.2,mm,at the detector"
    # No spacing, or one that makes no sense: the scan's own pixels.
    for meta in ({}, {"PixelSpacing": "0.7"}, {"PixelSpacing": "0\\0.7"}, {"PixelSpacing": "a\\b"}):
        assert _measure_scale(_scan(200, 300, **meta), 150, 100) == "2,2,px,"


class _Source:
    pass


def test_the_figure_names_its_view_and_frame_and_the_view_key_is_random_per_source(tmp_path):
    from PIL import Image

    from medvqa.imaging import load_scan
    from medvqa.ui.viewer import _view_key, _viewer_html

    first, second = _Source(), _Source()
    assert _view_key(first) == _view_key(first) != _view_key(second)
    assert re.fullmatch(r"[0-9a-f]{16}", _view_key(first))
    Image.fromarray(np.zeros((40, 60), np.uint8)).save(tmp_path / "scan.png")
    html = _viewer_html(load_scan(tmp_path / "scan.png"), view="abc")
    assert 'data-view="abc" data-frame="0" data-measure="1,1,px,"' in html
    assert 'width="60" height="40"' in html
