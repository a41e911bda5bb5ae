"""Training the embedded demo model: a tiny Grok-1-architecture network learned from the demo corpus.

network.py  float parameters in the reference's tree and a differentiable forward pass equal to the served one
data.py     the corpus as token streams (training / held-out) and reproducible batches of windows
export.py   int8 quantisation in the released layout, the checkpoint writer, held-out loss through serving code
loop.py     the optax training loop
__main__.py `python -m demo_build`: tokenizer + model + record, written into one folder (demo/)
"""
