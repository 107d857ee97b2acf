"""Checkpoint audits with tensor similarity next to the usual baselines.

* `.backdoor` — digits, a trigger patch fine-tuned into class 9: per-class slice similarity.
* `.forgetting` — a class curriculum on digits: per-class similarity to a reference.
* `.grokking` — modular addition: checkpoint x checkpoint similarity vs. accuracy curves.
* `.compare` — ``compare A B`` and ``matrix CKPT...`` over saved checkpoints.
* `.cli` — the command line (``tensoralg demo | audit | compare | matrix``).

Heavy imports (torch, matplotlib) happen inside the functions.
"""
