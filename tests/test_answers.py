"""Metrics and closed-question options."""

from medvqa.answers import closed_candidates, closed_correct, normalise, open_exact, open_recall


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
    assert closed_candidates("What organ is shown?") is None
    assert normalise("  T2-weighted,  MRI! ") == "t2-weighted mri"
