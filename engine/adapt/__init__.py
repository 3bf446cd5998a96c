"""What adapts: lookahead's arm and copy length, lookup's copy length, speculative's K and the
draft (policy.py), and the prices they read, measured once per machine and kept (cost.py).

Skip this folder to learn the algorithms: without a policy every decoder runs its paper's box
with fixed knobs. A policy may change speed, never tokens or the law.
"""
