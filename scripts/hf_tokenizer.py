"""Build a Hugging Face tokenizer directory from our SentencePiece model, offline.

Benchmark clients (AIPerf, guidellm, `vllm bench`) count tokens with a Hugging Face tokenizer named by
`--tokenizer`; nothing can be downloaded here, so this writes one (tokenizer.json + config) from the
same SentencePiece file the tokenizer service loads. It uses transformers' converter, which follows
the SentencePiece model's own settings (normalizer, dummy prefix, byte fallback, BPE merges from the
piece scores), and then checks that it encodes a sample of texts exactly as SentencePiece does: a
benchmark whose token counts were off would be worse than none.

Run it with a Python that has transformers, tokenizers and sentencepiece (`.venv-aiperf/`, the AIPerf
virtualenv of `python -m benchmarks.crosscheck`): `python scripts/hf_tokenizer.py --model tokenizer.model --out DIR`.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

SAMPLES = (
    "The answer to life the universe and everything is",
    "Permission is hereby granted, free of charge, to any person",
    "  leading spaces, trailing spaces  ",
    "numbers 0123456789 and punctuation!?;:()[]{}",
    "line one\nline two\ttabbed",
    "unicode: café, naïve, Grüße, 東京, emoji 🙂",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
)


def build(model: pathlib.Path) -> tuple[object, object]:
    """(transformers.PreTrainedTokenizerFast, sentencepiece.SentencePieceProcessor) of `model`."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model.read_bytes())
    processor = spm.SentencePieceProcessor(model_file=str(model))
    if proto.trainer_spec.model_type == sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
        vocab: object = [(p.piece, p.score) for p in proto.pieces]
    else:
        vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto=proto, vocab=vocab)
    if backend is None:
        raise SystemExit(f"{model}: unsupported SentencePiece model type {proto.trainer_spec.model_type}")
    spec = proto.trainer_spec

    def piece(index: int, fallback: str) -> str | None:
        return processor.id_to_piece(index) if index >= 0 else fallback or None

    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=piece(spec.bos_id, "<s>"), eos_token=piece(spec.eos_id, "</s>"),
        unk_token=piece(spec.unk_id, "<unk>"), pad_token=piece(spec.pad_id, ""), add_bos_token=False,
        add_eos_token=False, model_max_length=1 << 20), processor


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, type=pathlib.Path, help="SentencePiece .model file")
    parser.add_argument("--out", required=True, type=pathlib.Path, help="output directory")
    args = parser.parse_args(argv)
    tokenizer, processor = build(args.model)
    for text in SAMPLES:
        ours, reference = tokenizer.encode(text, add_special_tokens=False), processor.encode(text)
        if ours != reference:
            print(f"hf_tokenizer: encodes {text!r} as {ours}, SentencePiece as {reference}", file=sys.stderr)
            return 1
    tokenizer.save_pretrained(str(args.out))
    print(f"hf_tokenizer: wrote {args.out} ({len(tokenizer)} tokens; encodes {len(SAMPLES)} samples "
          "exactly as SentencePiece)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
