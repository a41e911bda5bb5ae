"""benchmarks/speculative.py's bookkeeping: which answers quote their prompt, and the on/off rates."""

from __future__ import annotations

from benchmarks.speculative import quotes, rates


def test_an_answer_quotes_its_prompt_only_as_one_contiguous_run() -> None:
    prompt = [5, 6, 7, 8, 2, 9, 10]
    assert quotes([6, 7, 8], prompt) and quotes(prompt, prompt)
    assert not quotes([6, 8], prompt)  # both in the prompt, not next to each other
    assert not quotes([9, 10, 11], prompt)  # runs past the prompt
    assert not quotes([], prompt)


def test_rates_divide_all_tokens_by_all_decode_time_and_take_medians_per_request() -> None:
    def run(tokens: int, seconds: float, messages: int, acceptance: float | None) -> dict:
        return {"ids": list(range(tokens)), "tokens_per_s": (tokens - 1) / seconds, "decode_seconds": seconds,
                "messages": messages, "acceptance": acceptance}

    out = rates({"on": [run(11, 1.0, 4, 0.5), run(21, 1.0, 5, 1.0)],
                 "off": [run(11, 2.0, 11, None), run(21, 4.0, 21, None)]}, 2)
    assert out["all_tokens_per_s_on"] == 15.0 and out["all_tokens_per_s_off"] == 5.0 and out["all_on_over_off"] == 3.0
    assert out["tokens_per_s_on"] == 15.0 and out["tokens_per_s_off"] == 5.0  # medians of (10, 20) and (5, 5)
    assert out["messages_on"] == 9 and out["acceptance_median"] == 0.75 and out["requests"] == 2
