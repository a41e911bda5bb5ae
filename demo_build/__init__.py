"""Training the embedded demo model: a tiny Grok-1-architecture network learned from the demo corpus.

network.py  float parameters in the reference's tree and a differentiable forward pass equal to the served one
data.py     the corpus as token streams (training / held-out) and reproducible batches of windows
export.py   int8 quantisation in the released layout, the checkpoint writer, held-out loss through serving code
loop.py     the optax training loop
presets.py  the named runs: `cpu` (the small model CI trains steps of) and `tpu` (the larger one, for a chip)
prepare_corpus.py  `python -m demo_build.prepare_corpus`: writes corpus/large/ once, from the Debian FAQ and docs/
__main__.py `python -m demo_build`: tokenizer + config + model + record, written into one folder (demo/)
"""
