"""Metrics and closed-question options."""

from medvqa.answers import closed_candidates, closed_correct, normalise, open_exact, open_recall, surface_forms


def test_yes_no_uses_the_first_yes_no_word_never_a_substring():
    assert closed_correct("No, the heart is normal.", "no")
    assert not closed_correct("Normal heart size.", "no")  # "no" inside "normal" does not count
    assert not closed_correct("Yes, but no effusion.", "no")  # the first yes/no word decides
    assert closed_correct("YES", "Yes")


def test_non_yes_no_closed_answers_must_match_exactly():
    assert closed_correct("Right.", "right")
    assert not closed_correct("right lung", "right")


def test_open_recall_counts_reference_words_present():
    assert open_recall("the right upper lobe", "Right upper lobe") == 1.0
    assert open_recall("left lung", "right lung") == 0.5
    assert open_recall("", "lung") == 0.0
    assert open_exact("Lung.", "lung") and not open_exact("lungs", "lung")


def test_candidates_come_from_the_question():
    assert closed_candidates("Is the lesion on the left or right?") == ["Left", "Right"]
    assert closed_candidates("Is this a CT or MRI?") == ["CT", "MRI"]
    assert closed_candidates("Which is bigger, liver or spleen?") == ["Liver", "Spleen"]
    assert closed_candidates("Is there a pleural effusion?") == ["Yes", "No"]
    assert closed_candidates("Any pleural effusion?") == ["Yes", "No"]  # clipped, as clinicians type
    assert closed_candidates("Anything abnormal in this image?") is None
    assert closed_candidates("Pleural effusion present?") == ["Yes", "No"]
    assert closed_candidates("In which vessel is calcification present?") is None
    assert closed_candidates("Present?") is None
    assert closed_candidates("What organ is shown?") is None
    assert normalise("  T2-weighted,  MRI! ") == "t2-weighted mri"


def test_candidates_read_comma_lists_and_multi_word_options():
    # Every option of a list counts, not just the words around the last "or" (SLAKE's phrasing).
    assert closed_candidates("Which is the biggest in this image,lung,liver or heart?") == ["Lung", "Liver", "Heart"]
    assert closed_candidates("Which type of modality is shown about this image, MRI, CT or X-Ray?") == [
        "MRI", "CT", "X-Ray"]
    assert closed_candidates("Which is bigger in this image, small bowel or kidney?") == ["Small bowel", "Kidney"]
    assert closed_candidates("Which is smaller in this image,liver or right kidney?") == ["Liver", "Right kidney"]
    assert closed_candidates("Where is the spleen in this image, right or lower right?") == ["Right", "Lower right"]
    # Serial comma: the first option is the end of the question's first part.
    assert closed_candidates("Is this a T1 weighted, T2 weighted, or FLAIR image?") == [
        "T1 weighted", "T2 weighted", "FLAIR"]
    assert closed_candidates("Are pleural opacities located on the left, right, or both sides of the lung?") == [
        "Left", "Right", "Both"]


def test_candidates_stop_where_the_option_ends():
    assert closed_candidates("Is the lesion on the left or right side of the brain?") == ["Left", "Right"]
    assert closed_candidates("Is the heart smaller or larger than if the image was taken AP?") == ["Smaller", "Larger"]
    assert closed_candidates("Is this an MRI or a CT scan?") == ["MRI", "CT"]
    # Shared trailing words make two-word options; both spellings are offered, the benchmarks use both.
    assert closed_candidates("Which plane is the image scanned, transverse plane or coronal plane?") == [
        "Transverse plane", "Coronal plane"]
    assert closed_candidates("Is this a T1 weighted or T2 weighted MRI image?") == [
        "T1 weighted", "T2 weighted", "T1", "T2"]


def test_a_question_naming_options_is_answered_with_one_of_them():
    assert closed_candidates("Is there hypoinflation or hyperinflation of the lung") == [
        "Hypoinflation", "Hyperinflation"]
    assert closed_candidates("Is this patient male or female?") == ["Male", "Female"]


def test_surface_forms_add_the_title_case_spelling():
    assert surface_forms("Small bowel") == ["Small bowel", "Small Bowel"]
    assert surface_forms("Yes") == ["Yes"]
    assert surface_forms("X-Ray") == ["X-Ray"]
