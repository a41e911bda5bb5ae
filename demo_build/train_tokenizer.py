"""`python -m demo_build.train_tokenizer --out PATH`: train the project's demo SentencePiece model.

The demo ("embedded default") stack needs a tokenizer that can be rebuilt from this repository
alone. This trains one from the original English text in `corpus/`: prose paragraphs (`*.txt`,
one per line) and question/answer dialogues (`*.jsonl`, one conversation per line) rendered through
the gateway's default chat template exactly as `/v1/chat/completions` renders a request, followed by
the assistant's answer. Both the tokenizer and the demo model learn from these documents, so the
demo model sees the chat format it is served with. A corpus may be several folders (the large demo's is
`corpus/` and `corpus/large/`), read in the order given. 1024 pieces by default (the model config's
vocab_size for the demo builds), BPE with
byte fallback (so any text round-trips), ids 0..3 = [PAD] [BOS] [EOS] [UNK] like the Grok-1
tokenizer, identity normalization, a dummy "▁" prefix and whitespace kept as is. One training
thread and no sampling make the output byte-for-byte reproducible.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Union

import sentencepiece

CORPUS_DIR = pathlib.Path(__file__).resolve().parent / "corpus"
VOCAB_SIZE = 1024
# One folder, or several read in order (each folder's files in name order).
CorpusDirs = Union[pathlib.Path, Sequence[pathlib.Path]]
SPECIAL_PIECES = {"pad": (0, "[PAD]"), "bos": (1, "[BOS]"), "eos": (2, "[EOS]"), "unk": (3, "[UNK]")}


def corpus_files(corpus_dir: CorpusDirs, pattern: str) -> list[pathlib.Path]:
    """The files matching `pattern` in each folder (not below it), folder by folder, in file-name order."""
    folders = [corpus_dir] if isinstance(corpus_dir, pathlib.Path) else list(corpus_dir)
    return [path for folder in folders for path in sorted(folder.glob(pattern))]


def corpus_lines(corpus_dir: CorpusDirs) -> Iterator[str]:
    """Non-empty lines of every *.txt file in the corpus folders, in file-name order."""
    files = corpus_files(corpus_dir, "*.txt")
    if not files:
        raise FileNotFoundError(f"no *.txt files in {corpus_dir}")
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                yield line


def dialogue_documents(corpus_dir: CorpusDirs) -> Iterator[str]:
    """Each conversation of every *.jsonl file (file-name order), as the text the served demo model sees:
    the gateway's chat template renders all messages but the last (with the generation prompt), and the
    last, the assistant's answer, follows after one space, as the model continues "Assistant:"."""
    # Imported here: only training needs the gateway's template, the tokenizer service never does.
    from gateway.http.chat import ChatTemplate
    from gateway.http.schemas import ChatMessage

    template = ChatTemplate.load()
    for path in corpus_files(corpus_dir, "*.jsonl"):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            *asked, answer = [ChatMessage(**message) for message in json.loads(line)["messages"]]
            if answer.role != "assistant" or not asked or not isinstance(answer.content, str):
                raise ValueError(f"{path}:{number}: a dialogue ends with the assistant's text answer")
            yield template.render(asked, add_generation_prompt=True) + " " + answer.content.strip()


def corpus_documents(corpus_dir: CorpusDirs) -> Iterator[str]:
    """The training documents: prose paragraphs, then rendered dialogues (each ends with EOS in training)."""
    yield from corpus_lines(corpus_dir)
    yield from dialogue_documents(corpus_dir)


def trainer_options(vocab_size: int = VOCAB_SIZE) -> dict[str, object]:
    """SentencePiece trainer settings of the demo model (fixed but for the size: they define the artifact)."""
    options: dict[str, object] = {
        "model_type": "bpe",
        "vocab_size": vocab_size,
        "byte_fallback": True,
        "character_coverage": 1.0,
        "normalization_rule_name": "identity",
        "add_dummy_prefix": True,
        "remove_extra_whitespaces": False,
        "split_digits": True,
        "num_threads": 1,
        "input_sentence_size": 0,
        "shuffle_input_sentence": False,
        "hard_vocab_limit": True,
        "minloglevel": 2,
    }
    for name, (token_id, piece) in SPECIAL_PIECES.items():
        options[f"{name}_id"] = token_id
        options[f"{name}_piece"] = piece
    return options


def train(corpus_dir: CorpusDirs = CORPUS_DIR, vocab_size: int = VOCAB_SIZE) -> bytes:
    """Train and return the serialized model."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=corpus_documents(corpus_dir), model_writer=model, **trainer_options(vocab_size)
    )
    return model.getvalue()


def write_atomically(data: bytes, out: pathlib.Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=out.parent, prefix=f".{out.name}.", delete=False) as tmp:
        tmp.write(data)
    os.replace(tmp.name, out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo_build.train_tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=pathlib.Path, help="where to write the .model file")
    parser.add_argument("--corpus", type=pathlib.Path, nargs="+", default=[CORPUS_DIR],
                        help="folders of *.txt and *.jsonl training text (default: the shipped demo corpus)")
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE, help="pieces (the model config's vocab_size)")
    args = parser.parse_args(argv)
    data = train(args.corpus, args.vocab_size)
    write_atomically(data, args.out)
    print(f"wrote {args.out} ({len(data)} bytes, {args.vocab_size} pieces)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
