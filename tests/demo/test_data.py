"""Training windows: drawn from the seed, and the share of them that repeat a document."""

from __future__ import annotations

import numpy as np

from demo_build.data import training_batches

EOS = 2


def stream_of(documents: list[list[int]]) -> np.ndarray:
    return np.asarray([t for d in documents for t in [*d, EOS]], np.int32)


def test_copy_windows_repeat_one_document_and_go_on_with_the_stream() -> None:
    documents = [[10 + i] * 3 + [100 + i, 200 + i] for i in range(12)]  # 5 tokens + EOS each
    stream = stream_of(documents)
    starts = np.flatnonzero(np.concatenate([[True], stream[:-1] == EOS]))
    windows = np.concatenate([next(b) for b in [training_batches(stream, starts, 64, 20, seed=1, eos=EOS,
                                                                 copy_share=0.25)] for _ in range(10)])
    copies = 0
    for w in windows:
        end = int(np.argmax(w == EOS)) + 1
        if (w[end:2 * end] == w[:end]).all():  # the document and its EOS, twice
            copies += 1
            first = int(np.flatnonzero((stream[:len(stream) - end + 1] == w[0]))[0])
            rest = np.concatenate([stream, stream])[first + end:first + end + len(w) - 2 * end]
            assert (w[2 * end:] == rest).all()  # then the stream after that document, as a plain window has it
        else:
            offset = int(np.flatnonzero(stream == w[0])[0])
            assert (w == np.concatenate([stream, stream])[offset:offset + 20]).all()
    assert 0.15 <= copies / len(windows) <= 0.35  # 64 x 10 windows, a quarter drawn as copies


def test_without_copies_the_windows_are_the_plain_ones_of_the_seed() -> None:
    stream = stream_of([[100 + i, 200 + i, 300 + i] for i in range(20)])
    starts = np.arange(0, len(stream), 4)
    plain = next(training_batches(stream, starts, 8, 9, seed=3))
    again = next(training_batches(stream, starts, 8, 9, seed=3, eos=EOS, copy_share=0.0))
    assert (plain == again).all()
    offsets = [int(np.flatnonzero(stream == w[0])[0]) for w in plain]
    assert all(o in set(starts.tolist()) for o in offsets)
