"""Tokenizer service: SentencePiece encode/decode and a streaming detokenizer behind gRPC (`python -m tokenizer_service`)."""
