"""medvqa.imaging.series and archive: several files opened as a study, slices in position order,
what is odd about a series said in words, and hostile archives refused before anything is extracted."""

from __future__ import annotations

import io
import json
import logging
import zipfile

import numpy as np
import pydicom
import pytest
from pydicom.dataset import Dataset

from medvqa.imaging import ScanError, ScanLimits, Window, open_study

from .imaging_helpers import PLANTED, ct_series, dicom_bytes, make_dicom, slice_hu, zip_bytes

READ_BACK = Window(200, 1000, "user")  # disc values 0..390 HU (slice index × 10) land on distinct grey levels


def slice_shown(scan) -> int:
    """Which synthetic slice a render shows, read back from its disc's grey level."""
    grey = float(scan.pixels[32, 32, 0])
    return int(round(((grey / 255) * (READ_BACK.width - 1) + READ_BACK.center - 0.5 - READ_BACK.width / 2) / 10))


def structured_report() -> bytes:
    ds = Dataset()
    ds.SOPClassUID = "1.2.840.10008.5.1.4.1.1.88.22"  # Enhanced SR
    ds.SOPInstanceUID = pydicom.uid.generate_uid()
    ds.Modality = "SR"
    ds.PatientName = PLANTED["PatientName"]
    return dicom_bytes(ds)


def test_a_shuffled_zip_opens_as_one_series_in_position_order():
    study = open_study(zip_bytes({f"study/{n:03d}.dcm": f for n, f in enumerate(ct_series(40))}))
    assert len(study.series) == 1 and study.notes == []
    series = study.series[0]
    assert series.modality == "CT" and series.frame_count == 40 and series.warnings == []
    assert series.positions_mm == [-50 + 2.5 * i for i in range(40)]
    for index in (0, 1, 17, 39):
        scan = series.render(READ_BACK, index)
        assert slice_shown(scan) == index
        assert (scan.frame_index, scan.frame_count, scan.series, scan.position_mm) == (index, 40, 1, -50 + 2.5 * index)
    assert series.render().frame_index == 20  # the middle slice first, as viewers open a stack


def test_one_window_for_the_whole_series_while_scrolling():
    series = open_study(ct_series(12)).series[0]
    windows = {series.render(frame=i).window for i in range(12)}
    assert len(windows) == 1 and next(iter(windows)).name == "auto-percentile"
    assert {series.render("lung", i).window.name for i in range(12)} == {"lung"}


def test_a_descending_normal_orders_by_position_along_it():
    # Orientation rows along x, columns along -y: the normal is -z, so positions count along -z.
    series = open_study(ct_series(6, orientation=(1, 0, 0, 0, -1, 0))).series[0]
    assert series.positions_mm == [-50 + 2.5 * i for i in range(6)]
    assert [slice_shown(series.render(READ_BACK, i)) for i in range(6)] == list(range(6))


def test_a_folder_with_a_report_and_stray_files_skips_them_with_notes(tmp_path):
    for n, data in enumerate(ct_series(8)):
        (tmp_path / "a" / "b").mkdir(parents=True, exist_ok=True)
        (tmp_path / "a" / "b" / f"IM{n}").write_bytes(data)
    (tmp_path / "report.dcm").write_bytes(structured_report())
    (tmp_path / "notes.txt").write_text("not an image")
    study = open_study(tmp_path)
    assert [s.frame_count for s in study.series] == [8]
    assert study.notes == ["Skipped 1 file: a Structured Report (no image).", "Skipped 1 file: not a DICOM file."]


def test_a_file_too_small_to_read_is_skipped_with_a_note_of_its_own():
    tiny = dicom_bytes(make_dicom(np.zeros((1, 1)), **PLANTED))
    study = open_study(ct_series(5) + [tiny])
    assert [s.frame_count for s in study.series] == [5]
    assert study.notes == ["Skipped 1 file: an image under 8 pixels a side, too small to read."]


def test_two_series_are_kept_apart_largest_first():
    study = open_study(ct_series(3) + ct_series(7, first=100))
    assert [(s.number, s.frame_count) for s in study.series] == [(1, 7), (2, 3)]
    assert study.series[0].positions_mm[0] == 100


def test_without_positions_slices_follow_the_instance_number():
    series = open_study(ct_series(5, placed=False)).series[0]
    assert series.positions_mm == [None] * 5
    assert [slice_shown(series.render(READ_BACK, i)) for i in range(5)] == list(range(5))
    assert "instance-number order" in series.warnings[0]


def test_two_orientations_in_one_series_are_said():
    uid = pydicom.uid.generate_uid()
    series = open_study(ct_series(4, series_uid=uid) + ct_series(3, series_uid=uid, orientation=(0, 1, 0, 0, 0, -1))
                        ).series[0]
    assert series.frame_count == 7
    assert "2 different orientations" in series.warnings[0]


def test_gaps_and_duplicate_positions_are_said():
    files = ct_series(10, shuffle_seed=None)
    gap = open_study(files[:4] + files[6:]).series[0]
    assert gap.warnings == ["The series has 1 gap where slices are missing: after slice 4 (7.5 mm); slices are "
                            "2.5 mm apart elsewhere."]
    uid = pydicom.uid.generate_uid()
    doubled = open_study(ct_series(5, series_uid=uid) + ct_series(2, series_uid=uid)).series[0]
    assert doubled.frame_count == 7 and "4 slices share their position" in doubled.warnings[0]


def test_copies_of_a_file_are_skipped_with_a_note():
    """A file selected twice, or the same instance exported again with other tags, is one slice; an
    instance whose pixels differ under the same SOP Instance UID shows something else and is kept."""
    files = ct_series(6, shuffle_seed=None)
    study = open_study(files + files[:2])
    assert [s.frame_count for s in study.series] == [6] and study.series[0].warnings == []
    assert study.notes == ["Skipped 2 files: a duplicate of another file in the upload."]

    again = pydicom.dcmread(io.BytesIO(files[3]))
    again.InstitutionName = "Another export"
    assert open_study(files + [dicom_bytes(again)]).notes == [
        "Skipped 1 file: a duplicate of another file in the upload."]
    again.PixelData = (again.pixel_array + 1).astype("<u2").tobytes()
    changed = open_study(files + [dicom_bytes(again)])
    assert changed.series[0].frame_count == 7 and changed.notes == []


def test_files_from_several_studies_are_said_without_naming_them():
    first, second = pydicom.uid.generate_uid(), pydicom.uid.generate_uid()
    study = open_study(ct_series(6, study_uid=first) + ct_series(4, study_uid=second, first=100))
    assert [s.frame_count for s in study.series] == [6, 4]
    assert study.notes == ["These files come from 2 different studies, so perhaps from different patients: "
                           "check that they belong together."]
    seen = " ".join([repr(study), *(repr(s._slices) for s in study.series)])
    assert first not in seen and second not in seen
    assert open_study(ct_series(6, study_uid=first) + ct_series(4, study_uid=first, first=100)).notes == []


def test_files_naming_different_patients_are_said_without_naming_them():
    """One study's files naming two patient IDs (files mixed up, or an archive filing two patients under
    one study) are said, as files of several studies are; the IDs are compared as keyed digests only."""
    uid, other = pydicom.uid.generate_uid(), "PAT-OTHER-4417"
    study = open_study(ct_series(6, study_uid=uid) + ct_series(4, study_uid=uid, first=100, PatientID=other))
    assert [s.frame_count for s in study.series] == [6, 4] and len(study.patients) == 2
    assert study.notes == ["These files name 2 different patients (their patient IDs differ): check that they "
                           "belong together."]
    seen = " ".join([repr(study), *(repr(s._slices) for s in study.series), *map(repr, study.patients)])
    assert other not in seen and PLANTED["PatientID"] not in seen
    assert open_study(ct_series(6) + ct_series(4, PatientID=other)).notes == [
        "These files name 2 different patients (their patient IDs differ), in 2 studies: check that they "
        "belong together."]
    # A file naming no patient ID is no other patient.
    assert open_study(ct_series(6, study_uid=uid) + ct_series(4, study_uid=uid, first=100, PatientID="")).notes == []


def test_a_folder_of_files_that_are_not_dicom_gets_a_message(tmp_path):
    for n in range(3):
        (tmp_path / f"file{n}.txt").write_text("hello")
    with pytest.raises(ScanError, match=r"None of the 3 files in this upload is a DICOM image\. "
                                        r"Skipped 3 files: not a DICOM file\."):
        open_study(tmp_path)


def test_an_image_whose_pixel_data_is_cut_off_is_noted_as_unreadable_not_as_holding_no_image():
    slices = ct_series(3)
    cut = pydicom.dcmread(io.BytesIO(slices[0]))
    del cut.PixelData
    study = open_study([dicom_bytes(cut), *slices[1:]])
    assert study.series[0].frame_count == 2
    assert study.notes == ["Skipped 1 file: a DICOM file that could not be read."], study.notes


def test_a_single_file_keeps_its_own_message():
    with pytest.raises(ScanError, match="Structured Report and holds no image"):
        open_study(structured_report())


@pytest.mark.parametrize("name", ["../escape.dcm", "a/../../escape.dcm", "/etc/escape.dcm", "C:/escape.dcm",
                                  "a\\..\\..\\escape.dcm"])
def test_a_zip_with_entries_pointing_outside_it_is_refused(name):
    with pytest.raises(ScanError, match="point outside it"):
        open_study(zip_bytes({"ok.dcm": ct_series(1)[0], name: ct_series(1)[0]}))


def test_a_zip_bomb_is_refused_before_it_is_extracted():
    bomb = zip_bytes({"slice.dcm": bytes(60 * 2**20)})  # 60 MB of zeros in about 60 kB
    assert len(bomb) < 2**20
    with pytest.raises(ScanError, match="zip bomb"):
        open_study(bomb)
    with pytest.raises(ScanError, match="zip bomb"):  # many entries, each under the per-entry floor
        open_study(zip_bytes({f"{n}.dcm": bytes(2**20) for n in range(40)}))


def test_a_zip_of_ten_thousand_tiny_files_is_refused_by_count():
    archive = zip_bytes({f"f{n}": b"x" for n in range(10_000)}, compression=zipfile.ZIP_STORED)
    with pytest.raises(ScanError, match="holds 10,000 files or more; at most 4,096"):
        open_study(archive)


def test_nested_archives_are_refused(tmp_path):
    inner = zip_bytes({"a.dcm": ct_series(1)[0]})
    with pytest.raises(ScanError, match="nested archives"):
        open_study(zip_bytes({"inner.zip": inner}))
    with pytest.raises(ScanError, match="nested archives"):
        open_study(zip_bytes({"inner.bin": inner}))  # told by content, not by name
    (tmp_path / "series.zip").write_bytes(inner)
    with pytest.raises(ScanError, match="nested archives"):
        open_study(tmp_path)


def test_caps_apply_to_folders_and_lists(tmp_path):
    limits = ScanLimits(max_files=5)
    with pytest.raises(ScanError, match="at most 5"):
        open_study(ct_series(6), limits)
    for n, data in enumerate(ct_series(6)):
        (tmp_path / f"{n}.dcm").write_bytes(data)
    with pytest.raises(ScanError, match="at most 5"):
        open_study(tmp_path, limits)
    with pytest.raises(ScanError, match="limit for one upload"):
        open_study(tmp_path, ScanLimits(max_total_bytes=20_000))


def test_no_planted_patient_data_passes_the_boundary(tmp_path, caplog, capsys):
    from medvqa.__main__ import main

    caplog.set_level(logging.DEBUG)
    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{PLANTED['PatientName']}/{n}.dcm": f for n, f in enumerate(ct_series(6))}))
    study = open_study(archive)
    series = study.series[0]
    scan = series.render("lung", 2)
    assert main(["scan", str(archive), "--json"]) == 0
    assert main(["scan", str(archive)]) == 0
    seen = " ".join([repr(study), repr(series), repr(scan), json.dumps(series.summary()), series.describe(),
                     json.dumps(scan.safe_meta), caplog.text, *capsys.readouterr()])
    for value in PLANTED.values():
        for part in value.replace("^", " ").split():
            assert part not in seen, part
    assert not hasattr(series, "uid") and all(len(v) < 40 for v in scan.safe_meta.values())


def test_scan_json_lists_series_in_display_order(tmp_path, capsys):
    from medvqa.__main__ import main

    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{n}.dcm": f for n, f in enumerate(ct_series(40))}))
    assert main(["scan", str(archive), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == {"series": [{"modality": "CT", "slices": 40, "positions_mm": [-50 + 2.5 * i for i in range(40)],
                                   "warnings": [], "burned_in_slices": 0}], "notes": []}


def test_ask_slice_k_shows_the_model_that_slice(tmp_path, capsys, monkeypatch, tiny_pipeline):
    from medvqa.__main__ import main
    from medvqa.pipeline import Pipeline

    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{n}.dcm": f for n, f in enumerate(ct_series(12))}))
    seen = []
    original = tiny_pipeline.new_conversation
    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline))
    monkeypatch.setattr(tiny_pipeline, "new_conversation", lambda scan: seen.append(scan) or original(scan))
    assert main(["ask", str(archive), "Is there a mass?", "--slice", "4", "--window", "200,1000",
                 "--no-retrieval"]) == 0
    (scan,) = seen
    assert scan.frame_index == 3 and slice_shown(scan) == 3 and scan.window.center == 200
    assert np.array_equal(scan.pixels, open_study(archive).series[0].render(READ_BACK, 3).pixels)
    assert main(["ask", str(archive), "Is there a mass?", "--slice", "13"]) == 2
    assert "Slice 13 was requested, but this series has 12 slices (1 to 12)" in capsys.readouterr().err
    assert main(["ask", str(archive), "Is there a mass?", "--series", "2"]) == 2
    assert "Series 2 was requested, but this upload has 1 series (1 to 1)" in capsys.readouterr().err
    study = tmp_path / "two.zip"
    uid = pydicom.uid.generate_uid()
    study.write_bytes(zip_bytes({f"{n}.dcm": f for n, f in enumerate(ct_series(6, study_uid=uid)
                                                                     + ct_series(4, study_uid=uid, first=100))}))
    seen.clear()
    assert main(["ask", str(study), "Is there a mass?", "--series", "2", "--slice", "1", "--no-retrieval"]) == 0
    (scan,) = seen
    assert (scan.series, scan.frame_count, scan.frame_index) == (2, 4, 0)


def test_ask_refuses_a_ct_preset_for_an_image_without_hounsfield_units(tmp_path, capsys, monkeypatch, tiny_pipeline):
    """As the page offers the CT presets for a CT only, `ask --window lung` refuses a PNG, and an MR, with
    the reason, before any model is loaded; a CT takes it."""
    from PIL import Image

    from medvqa.__main__ import main
    from medvqa.pipeline import Pipeline

    monkeypatch.setattr(Pipeline, "load", classmethod(lambda cls, *a, **k: tiny_pipeline))
    picture = tmp_path / "chest.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64), dtype=np.uint8)).save(picture)
    mr = tmp_path / "mr.dcm"
    mr.write_bytes(dicom_bytes(make_dicom(np.full((32, 32), 300, np.uint16), Modality="MR")))
    for path, kind in ((picture, "a PNG image"), (mr, "a MR DICOM image")):
        assert main(["ask", str(path), "Is there a mass?", "--window", "lung", "--no-retrieval"]) == 2
        assert f"The lung window is a CT window in Hounsfield units, which {kind} does not have" in \
            capsys.readouterr().err
    assert main(["ask", str(picture), "Is there a mass?", "--window", "auto", "--no-retrieval"]) == 0
    archive = tmp_path / "study.zip"
    archive.write_bytes(zip_bytes({f"{n}.dcm": f for n, f in enumerate(ct_series(4))}))
    assert main(["ask", str(archive), "Is there a mass?", "--window", "lung", "--no-retrieval"]) == 0
    assert "(image window: lung" in capsys.readouterr().out


def test_each_slice_gives_its_own_pixel_spacing():
    """A localiser or another field of view in the series: a slice's size and spacing are its own (the page's
    ruler measures with them), the rest of the series' fields are the middle slice's."""
    from medvqa.imaging import open_study

    from .imaging_helpers import ct_series, zip_bytes

    import pydicom

    uids = {"series_uid": pydicom.uid.generate_uid(), "study_uid": pydicom.uid.generate_uid()}
    files = ct_series(5, shuffle_seed=None, PixelSpacing=[0.5, 0.5], **uids)
    files[0] = ct_series(1, shuffle_seed=None, first=-50.0, PixelSpacing=[1.5, 1.5], **uids)[0]
    (series,) = open_study(zip_bytes({f"{n}.dcm": f for n, f in enumerate(files)})).series
    spacings = [series.render(frame=i).safe_meta.get("PixelSpacing") for i in range(series.frame_count)]
    assert spacings == ["1.5\\1.5"] + ["0.5\\0.5"] * 4
    assert series.safe_meta["PixelSpacing"] == "0.5\\0.5"


def test_reading_a_pixel_of_a_slice_not_shown_keeps_nothing_decoded():
    from medvqa.imaging import open_study

    from .imaging_helpers import ct_series, slice_hu, zip_bytes

    (series,) = open_study(zip_bytes({f"{n}.dcm": f for n, f in enumerate(ct_series(5, shuffle_seed=None))})).series
    series.render(frame=3)
    shown = series.decoded_bytes
    assert series.value_at(1, 10, 20) == slice_hu(1)[10, 20]
    assert series._slices[1].source.decoded_bytes == 0 and series.decoded_bytes == shown
    assert series.value_at(3, 10, 20) == slice_hu(3)[10, 20] and series.decoded_bytes == shown


def _enhanced_ct(stored_at: list[float], *, orientations=None, shared_orientation=(1, 0, 0, 0, 1, 0)) -> bytes:
    """An enhanced multi-frame CT whose frame k shows slice_hu(stored_at[k] / 10) and lies at z = stored_at[k]
    (its Plane Position per frame; the orientation shared, or per frame from `orientations`)."""
    frames = np.stack([slice_hu(int(z // 10)) + 1024 for z in stored_at])
    ds = make_dicom(frames, RescaleSlope=1, RescaleIntercept=-1024)
    shared = Dataset()
    plane = Dataset()
    plane.ImageOrientationPatient = [float(v) for v in shared_orientation]
    shared.PlaneOrientationSequence = [plane]
    ds.SharedFunctionalGroupsSequence = [shared]
    ds.PerFrameFunctionalGroupsSequence = []
    for k, z in enumerate(stored_at):
        group, position = Dataset(), Dataset()
        position.ImagePositionPatient = [0.0, 0.0, float(z)]
        group.PlanePositionSequence = [position]
        if orientations is not None:
            own = Dataset()
            own.ImageOrientationPatient = [float(v) for v in orientations[k]]
            group.PlaneOrientationSequence = [own]
        ds.PerFrameFunctionalGroupsSequence.append(group)
    return dicom_bytes(ds)


def test_an_enhanced_multiframe_file_shows_its_frames_in_position_order():
    """PS3.3 C.7.6.16.2.2: an enhanced file's frames may be stored in any order; each says where it lies.
    They are shown along the slice normal, as a series' slices are, with their positions and gaps."""
    one_file = _enhanced_ct([30, 10, 40, 20])
    series = open_study(one_file).series[0]
    assert series.positions_mm == [10.0, 20.0, 30.0, 40.0] and series.warnings == []
    assert [slice_shown(series.render(READ_BACK, i)) for i in range(4)] == [1, 2, 3, 4]
    assert open_study([one_file]).series[0].positions_mm == [10.0, 20.0, 30.0, 40.0]  # one file of several
    gap = open_study(_enhanced_ct([10, 20, 30, 60])).series[0]
    assert "1 gap" in gap.warnings[0]
    # Frames in two orientations (a three-plane localiser): stored order, said.
    mixed = open_study(_enhanced_ct([10, 20, 30], orientations=[(1, 0, 0, 0, 1, 0)] * 2 + [(0, 1, 0, 0, 0, -1)]))
    assert [slice_shown(mixed.series[0].render(READ_BACK, i)) for i in range(3)] == [1, 2, 3]
    assert "2 different orientations" in mixed.series[0].warnings[0]


def test_a_multiframe_file_without_positions_keeps_its_stored_order_without_a_warning():
    """A cine loop or an older multi-frame file: its frames' order is their order in time."""
    frames = np.stack([slice_hu(k) + 1024 for k in (3, 1, 2)])
    series = open_study(dicom_bytes(make_dicom(frames, RescaleSlope=1, RescaleIntercept=-1024))).series[0]
    assert [slice_shown(series.render(READ_BACK, i)) for i in range(3)] == [3, 1, 2]
    assert series.positions_mm == [None] * 3 and series.warnings == []
    # An enhanced cine (every frame at one place) or two time points over the same slices: stored order too.
    for stored_at in ([20, 20, 20], [10, 20, 30, 10, 20, 30]):
        frames_of = open_study(_enhanced_ct(stored_at)).series[0]
        assert [slice_shown(frames_of.render(READ_BACK, i)) for i in range(len(stored_at))] == \
            [z // 10 for z in stored_at]
        assert frames_of.warnings == [] and frames_of.positions_mm == [None] * len(stored_at)


def test_slices_of_another_size_in_a_series_are_said():
    """A localiser filed with its stack, or another field of view: scrolling jumps in scale."""
    study_uid, series_uid = pydicom.uid.generate_uid(), pydicom.uid.generate_uid()
    files = ct_series(5, series_uid=series_uid, study_uid=study_uid)
    small = make_dicom(slice_hu(5, size=48) + 1024, RescaleSlope=1, RescaleIntercept=-1024,
                       StudyInstanceUID=study_uid, SeriesInstanceUID=series_uid, InstanceNumber=6,
                       ImageOrientationPatient=[1.0, 0, 0, 0, 1, 0], ImagePositionPatient=[0.0, 0, -37.5])
    series = open_study(files + [dicom_bytes(small)]).series[0]
    assert series.frame_count == 6
    assert series.warnings == ["1 of the 6 slices differs in size from the rest (64×64 pixels): perhaps a localiser "
                               "or another field of view; each is shown at its own size."]
    assert open_study(files).series[0].warnings == []
