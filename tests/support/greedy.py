"""Comparing a P/D greedy answer with P alone's, token by token, where logits tie at bf16's resolution.

With seeded random weights a model's top logits crowd together: near the top (magnitudes 4-8) bf16 logits are
spaced 2**-5 apart, and about one token in ten has its runner-up within a step or two. P/D computes the last
prompt token on D, in a one-token forward over P's KV, where P alone computed it inside the prompt's forward: the
same math in another kernel shape, equal to the last bits or not. A greedy answer may then leave P alone's at such
a tie, and from there on the two continuations are different texts. Wrong KV does not look like that: it moves
logits by far more than a step, so the first differing token is not P alone's runner-up at a near-tie.

The rule (as vLLM's own tests compare outputs, with the margin bounded): the answers are equal, or where they
first differ P/D's token is P alone's second choice and P alone's top two log-probabilities there lie within
TIE_NATS of each other.
"""

from __future__ import annotations

__all__ = ["TIE_NATS", "same_tokens", "tie_verdict"]

TIE_NATS = 0.07  # two bf16 steps of a logit between 4 and 8


def _norm(token: str) -> str:
    return token.strip().lstrip("\u0120\u2581")


def same_tokens(got: list[str], want: list[str]) -> bool:
    """Token for token the same, spaces and tokenizer markers aside."""
    return [_norm(t) for t in got] == [_norm(t) for t in want]


def tie_verdict(got: list[str], want: list[str], want_top: list[dict[str, float]], tie_nats: float = TIE_NATS) -> str | None:
    """None when `got` equals `want` or leaves it only at a near-tie (module doc); otherwise why not, in one line.

    `want` and `want_top` are P alone's tokens and its top-2 log-probabilities per position (the OpenAI
    completions `logprobs` fields, `logprobs=2`); `got` is P/D's tokens.
    """
    if len(want_top) != len(want):
        return f"P alone gave {len(want)} tokens but {len(want_top)} top-logprob entries"
    got, want = [_norm(t) for t in got], [_norm(t) for t in want]
    for k, (g, w) in enumerate(zip(got, want, strict=False)):
        if g == w:
            continue
        top = {_norm(t): lp for t, lp in want_top[k].items()}
        if w not in top:
            return f"token {k}: P alone's top log-probabilities {want_top[k]} do not name its own token {w!r}"
        if g not in top:
            return f"token {k}: P/D gave {g!r}, not among P alone's top choices there ({w!r}; {want_top[k]})"
        margin = top[w] - top[g]
        if abs(margin) > tie_nats:
            return f"token {k}: P/D gave P alone's runner-up {g!r}, {margin:.3f} nats behind {w!r} (a tie is within {tie_nats})"
        return None
    if len(got) != len(want):
        return f"P/D gave {len(got)} tokens, P alone {len(want)}"
    return None
