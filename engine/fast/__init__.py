"""The exact fast paths: prepacked and 4-bit matmuls (packed.py), attention whose rows round
alike however many share a call and the probe that checks it (invariant.py), the 4-bit step
compiled ahead of time (aot.py), and what they keep on disk (artifacts.py).

Skip this folder to learn the algorithms: it changes how fast a forward is, never what a
decoder computes (tests hold every decoder to its path's plain, bit for bit).
"""
