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


def test_a_pixel_value_is_said_in_its_unit_and_place():
    from medvqa.ui.viewer import _pixel_value_text, _probe_html

    ct = SimpleNamespace(is_dicom=True, safe_meta={"Modality": "CT"})
    mr = SimpleNamespace(is_dicom=True, safe_meta={"Modality": "MR"})
    picture = SimpleNamespace(is_dicom=False, safe_meta={})
    assert _pixel_value_text(ct, -850.0, 29, 63) == "-850 HU at column 64, row 30"
    assert _pixel_value_text(mr, 1234.0, 0, 0) == "value 1234 at column 1, row 1"
    assert _pixel_value_text(picture, 0.123456, 4, 9) == "value 0.1235 at column 10, row 5 (as stored: no unit)"
    assert _pixel_value_text(picture, (200, 30, 90), 0, 0) == "RGB 200, 30, 90 at column 1, row 1"
    assert _probe_html("k<:3", "7", "a & b") == \
        '<span class="medvqa-probe" data-for="k&lt;:3" data-click="7">a &amp; b</span>'


def test_the_value_tool_reads_the_slice_shown(tiny_pipeline, tmp_path):
    """handlers.probe: the point as fractions of the image shown, the pixel of the frame on screen; nonsense
    or no scan gives nothing."""
    from medvqa.imaging import open_study
    from medvqa.ui.handlers import _Handlers
    from medvqa.ui.session import _Session
    from medvqa.ui.viewer import _view_key

    from .imaging_helpers import ct_series, slice_hu, zip_bytes

    handlers = _Handlers(tiny_pipeline, tiny_pipeline.settings, 100)
    (series,) = open_study(zip_bytes({f"{n}.dcm": f for n, f in enumerate(ct_series(5, shuffle_seed=None))})).series
    scan = series.render(frame=3)
    session = _Session(tiny_pipeline, series, scan, tiny_pipeline.new_conversation(scan))
    shown = f"{_view_key(series)}:3"
    expected = int(slice_hu(3)[16, 48])  # (64 x 64 slices: row 16, column 48)
    assert handlers.probe(f"0.76,0.26,1,{shown}", session) == \
        f'<span class="medvqa-probe" data-for="{shown}" data-click="1">{expected} HU at column 49, row 17</span>'
    assert series.value_at(3, 16, 48) == expected
    assert handlers.probe(f"1.5,-2,2,{shown}", session).endswith("HU at column 64, row 1</span>")  # clamped
    # A click on a slice no longer shown (the reader scrolled on) is not answered with the one shown.
    assert handlers.probe(f"0.5,0.5,3,{_view_key(series)}:2", session) == ""
    assert handlers.probe(f"nan,0.5,4,{shown}", session) == handlers.probe("x", session) == ""
    assert handlers.probe(f"0.5,0.5,5,{shown}", None) == ""
    tiny_pipeline.end_conversation(session.conversation)


def test_a_scan_that_says_text_is_burned_into_its_pixels_is_shown_with_a_warning(tmp_path, capsys):
    """Burned In Annotation YES: the viewer, the export and the command line say that the pixels may name
    the patient, and that the model reads them; a file saying NO, or nothing, gets no warning."""
    from medvqa.imaging import BURNED_IN_NOTE, burned_in, cli_scan, cli_scan_study, load_scan, open_study
    from medvqa.ui.transcript import _download_links, _transcript_record, export_markdown
    from medvqa.ui.viewer import _viewer_html

    from .imaging_helpers import ct_series, dicom_bytes, make_dicom, zip_bytes

    stored = np.arange(64 * 64, dtype=np.uint16).reshape(64, 64) % 4000
    for flag, warned in (("YES", True), ("NO", False), (None, False)):
        extra = {"BurnedInAnnotation": flag} if flag is not None else {}
        path = tmp_path / f"scan-{flag}.dcm"
        path.write_bytes(dicom_bytes(make_dicom(stored, **extra)))
        scan = load_scan(path)
        assert burned_in(scan.safe_meta) is warned
        assert ('class="medvqa-warning" role="note"' in _viewer_html(scan)) is warned
        assert cli_scan(str(path)) == 0
        assert (BURNED_IN_NOTE in capsys.readouterr().out) is warned

    source = SimpleNamespace(source_format="dicom", frame_count=1, safe_meta={"Modality": "US", "BurnedInAnnotation": "YES"})
    record = _transcript_record(SimpleNamespace(source=source, study=None, turns=[]), SimpleNamespace(profile="tiny"))
    assert record["scan"]["burned_in_annotation"] is True
    assert "burned into its pixels" in export_markdown(record) and "No patient data." not in export_markdown(record)
    assert "burned into its pixels" in _download_links("", "", burned_in_annotation=True)
    assert "no patient data, no image" in _download_links("", "")

    # A series: each slice says it for itself, and the command line counts them.
    files = ct_series(4) + ct_series(2, BurnedInAnnotation="YES")
    folder = tmp_path / "study.zip"
    folder.write_bytes(zip_bytes({f"f{i}.dcm": data for i, data in enumerate(files)}))
    study = open_study(str(folder))
    assert [s.burned_in_slices for s in study.series] == [0, 2]
    flagged = study.series[1]
    assert 'class="medvqa-warning"' in _viewer_html(flagged.render(frame=1))
    assert 'class="medvqa-warning"' not in _viewer_html(study.series[0].render(frame=1))
    assert cli_scan_study(str(folder), as_json=False) == 0
    assert "2 of 2 slices say text is burned into their pixels" in capsys.readouterr().out
