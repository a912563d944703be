"""nbtrain.course: the "predict, then run" exercises of the notebooks."""

import math

from nbtrain.course import check, matches


def test_matches_numbers_text_and_sequences():
    assert matches(8, 8) and matches(8.0, 8) and not matches(7, 8)
    assert matches(0.95, 1.0, tolerance=0.1) and not matches(0.8, 1.0, tolerance=0.1)
    assert matches(" BF16 ", "bf16") and not matches("fp16", "bf16")
    assert matches([1, 2.0], (1, 2)) and not matches([1, 2], [1, 2, 3])
    assert matches(True, True) and not matches(1, True) and not matches(False, 0)
    assert matches(math.nan, float("nan")) and not matches(1.0, math.nan)
    assert matches({"a"}, {"a"}) and not matches({"a"}, {"b"})


def test_check_says_right_wrong_or_no_guess_and_why(capsys):
    assert check(8, 8, "micro-batch 2 x accumulation 4") is True
    out = capsys.readouterr().out
    assert out.startswith("Right: 8.") and "Why: micro-batch 2 x accumulation 4" in out
    assert check(4, 8) is False
    assert "you guessed 4; the answer is 8" in capsys.readouterr().out
    assert check(..., 0.12345, "because") is None   # Run All with no guess written: the answer and why, no error
    out = capsys.readouterr().out
    assert "No guess yet" in out and "0.1235" in out and "Why: because" in out
