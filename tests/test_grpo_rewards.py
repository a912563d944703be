"""GRPO's reward functions (engine/rewards.py): the built-ins against hand-computed values, callables as TRL calls
them, weights, and every bad input or failing reward named."""

import pytest

from nbtrain.engine.rewards import RewardError, parse_rewards, score

PROMPTS = ["p1", "p1", "p2"]
DONE = ["<a>42</a>", "forty-two", " 7 "]


def test_the_builtins():
    rewards = parse_rewards(["length:4", "format:^<a>.*</a>$", "exact", "contains"])
    each, total = score(rewards, PROMPTS, DONE, {"answer": ["42", "42", "7"], "completion_tokens": [4, 2, 8]})
    assert each["length:4"] == [1.0, 0.5, 0.0]                   # 1 - |n - 4| / 4, never below 0
    assert each["format:^<a>.*</a>$"] == [1.0, 0.0, 0.0]
    assert each["exact"] == [0.0, 0.0, 1.0]                      # stripped on both sides
    assert each["contains"] == [1.0, 0.0, 1.0]
    assert total == [3.0, 0.5, 2.0]


def test_a_callable_gets_the_columns_and_weights_apply():
    seen = {}

    def longer(prompts, completions, **columns):
        seen.update(columns, prompts=prompts)
        return [len(c) for c in completions]

    rewards = parse_rewards([longer, "exact"], reward_weights=[0.5, 2])
    each, total = score(rewards, PROMPTS, DONE, {"answer": ["42", "x", "7"], "level": [1, 2, 3]})
    assert seen["level"] == [1, 2, 3] and seen["prompts"] == PROMPTS
    assert each["longer"] == [9.0, 9.0, 3.0] and total == [4.5, 4.5, 3.5]


@pytest.mark.parametrize("reward,weights,message", [
    ("length:0", None, r"reward: 'length:0': length:N takes a whole number of tokens N >= 1"),
    ("length:x", None, r"length:N takes a whole number"),
    ("format:(", None, r"reward: 'format:\(': not a regular expression"),
    ("format:", None, r"format:REGEX needs a pattern"),
    ("bleu", None, r"reward: unknown 'bleu' \(built-ins: length:N, format:REGEX, exact, contains; 'module:function'; or a function"),
    ([], None, r"reward: give one or more reward functions"),
    (3, None, r"reward: 3 is neither a name nor a function"),
    (["exact", "exact"], None, r"reward: each reward once"),
    (["exact", "contains"], [1.0], r"reward_weights: one weight per reward \(2: \['exact', 'contains'\]\), got 1"),
    (["exact"], [float("nan")], r"reward_weights: each weight is a finite number"),
])
def test_bad_rewards_are_named(reward, weights, message):
    with pytest.raises(RewardError, match=message):
        parse_rewards(reward, weights)


def test_a_failing_reward_is_named():
    def boom(prompts, completions, **_):
        raise ZeroDivisionError("no")

    def short(prompts, completions, **_):
        return [1.0]

    def words(prompts, completions, **_):
        return ["a"] * len(completions)

    def nan(prompts, completions, **_):
        return [float("nan")] * len(completions)

    for fn, message in ((boom, r"reward 'boom' raised ZeroDivisionError: no"),
                        (short, r"reward 'short': returned 1 values for 3 completions"),
                        (words, r"reward 'words': returned .*, not a list of numbers"),
                        (nan, r"reward 'nan': returned nan, not a finite number")):
        with pytest.raises(RewardError, match=message):
            score(parse_rewards(fn), PROMPTS, DONE)
    with pytest.raises(RewardError, match=r"reward 'exact': needs the data's 'answer' column; the data has \['q'\]"):
        score(parse_rewards("exact"), PROMPTS, DONE, {"q": [1, 2, 3]})
