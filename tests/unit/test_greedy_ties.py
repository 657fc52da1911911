"""The GPU tier's rule for comparing P/D's greedy answer with P alone's (tests/support/greedy.py)."""

from support.greedy import TIE_NATS, same_tokens, tie_verdict

WANT = ["t1", "t2", "t3", "t4"]
TOP = [{"t1": -1.0, "t9": -1.5}, {"t2": -2.0, "t7": -2.03}, {"t3": -1.0, "t8": -3.0}, {"t4": -0.5, "t5": -0.9}]


def test_equal_answers_agree() -> None:
    assert tie_verdict(list(WANT), WANT, TOP) is None


def test_leaving_at_a_near_tie_for_the_runner_up_agrees() -> None:
    assert tie_verdict(["t1", "t7", "t0", "t0"], WANT, TOP) is None


def test_an_exact_tie_agrees_whichever_way_it_fell() -> None:
    top = [{"t1": -1.0, "t9": -1.0}] + TOP[1:]
    assert tie_verdict(["t9", "t2"], WANT, top) is None


def test_leaving_where_the_margin_is_wide_is_a_difference() -> None:
    why = tie_verdict(["t9", "t2", "t3", "t4"], WANT, TOP)
    assert why is not None and "token 0" in why and "0.500 nats" in why


def test_a_token_outside_p_alones_top_choices_is_a_difference() -> None:
    why = tie_verdict(["t1", "t6"], WANT, TOP)
    assert why is not None and "not among P alone's top choices" in why


def test_a_shorter_answer_is_a_difference() -> None:
    assert tie_verdict(["t1", "t2"], WANT, TOP) == "P/D gave 2 tokens, P alone 4"


def test_tokenizer_markers_and_spaces_are_not_differences() -> None:
    top = [{" t1": -1.0, "\u0120t9": -1.5}] + TOP[1:]
    assert tie_verdict(["t1", "t2", "t3", "t4"], [" t1", "t2", "t3", "t4"], top) is None


def test_the_bound_is_two_bf16_steps_near_the_top() -> None:
    assert 2 * 2**-5 <= TIE_NATS < 3 * 2**-5


def test_same_tokens_ignores_spaces_and_markers_only() -> None:
    assert same_tokens(["t1", "t2"], [" t1", "\u0120t2"])
    assert not same_tokens(["t1", "t2"], ["t1", "t3"])
