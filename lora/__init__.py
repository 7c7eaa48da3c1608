"""LoRA files for the Wan DiT: format detection (formats.py), module names resolved to ours
(keymap.py), files read against a model with every shape checked (file.py), the merge
arithmetic (merge.py), unmerged low-rank layers (layers.py), bringing a model to the LoRAs its
handle asks for (apply.py) and a whole checkpoint merged into a new file (merge_file.py).
"""
