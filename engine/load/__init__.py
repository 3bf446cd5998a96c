"""Loading: HF-format checkpoints read strictly (weights.py), config.json (config.py), the
tokenizer (tokenizer.py) and chat templates rendered sandboxed (template.py).

Skip this folder to learn the algorithms.
"""
